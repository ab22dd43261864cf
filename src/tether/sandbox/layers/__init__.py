"""The change-capture layers: what a command wrote, listed, held for approval and applied.

`layer` (scan, conflicts, apply, discard of one command's overlay layer), `held` (layers held for a
person's approval), `fs` (the file operations beneath a directory fd that both, and the file tools'
jail, go through) and `filedata` (a file's data copied and compared, holes kept). Import the modules
themselves: this file imports nothing.
"""
