"""End-to-end tests: the installed `dflash-mac` command in fresh subprocesses."""
