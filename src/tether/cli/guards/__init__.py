"""What stands between a `tether` command and the machine before (and after) it runs: the root guard
(`root_guard`: `--allow-root`), the device state directory's lock (`state_lock`: one process per state
directory) and the one-line report of an exception no command caught (`unhandled`). Neither typer nor click is
imported by `state_lock` and `unhandled` (`tether exec`'s fast path uses them). This package imports nothing
itself."""
