"""The accessibility tree (AT-SPI 2) over D-Bus: `bus` (finding the accessibility bus and calling it),
`tree` (reading applications and their elements), `act` (actions, text and focus on one element).

AT-SPI is spoken directly over D-Bus with `jeepney` (pure Python), so no GObject bindings are needed.
Importing this package imports nothing else; import the module you need.
"""
