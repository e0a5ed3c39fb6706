from fastclip.cli import entry

entry()
