"""The `tether` sub-commands, one module per command group, in families (sub-packages): `tasks`, `fleet`, `setup`.
Importing a module attaches its commands to the typer apps in `tether.cli.common`; `tether.cli.lazy.COMMANDS`
names the modules each top-level command needs, and they are imported only when that command runs or shows its
help. This package imports nothing itself."""
