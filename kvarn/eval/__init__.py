"""`kvarn eval`: accuracy and fidelity of KV-cache formats (aime25/aime24, gsm8k, math500, niah, ppl), offline
data, paired statistics against the fp16 cache, and an lm-eval bridge. See `kvarn eval --help`."""
from .tasks import TASKS, get_task, task_names

__all__ = ["TASKS", "get_task", "task_names"]
