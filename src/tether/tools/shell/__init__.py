"""The shell family: `tool` (`shell_execute`, `shell_execute_read`), `rules` (each program's own escapes,
checked by the command policy), `code` (reading the code a program is given: sed scripts, short and
long options), `capture` (what a sandboxed command changed: listed, held, applied, journaled) and `change_rules`
(how those changes are judged: the approval each needs, what is refused).

Importing this package imports nothing else; import the module you need.
"""
