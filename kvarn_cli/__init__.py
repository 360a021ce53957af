"""The `kvarn` command line: thin Typer commands that parse, call the library and print."""
