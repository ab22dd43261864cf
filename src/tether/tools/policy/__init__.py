"""The rules every tool obeys, as pure functions of a `Policy`.

`model` (the `Policy` itself and loading it), `command_checks` (the command and environment checks), `overlay`
(the part a server sets on top of a device's own), `jail` (every path a tool touches, resolved and
checked), `hidden` (hidden paths), `path_rules` and `protected_defaults` (protected paths), `approval`
(the digest that binds an approval to what the person saw).

Importing this package imports nothing else; import the module you need.
"""
