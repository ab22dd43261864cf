"""The browser family (Chromium through Playwright): `tool` (the `browser.act` tool and its tool set),
`actions` (what each action does on a page), `session` (the browser, its contexts and pages), `urls`
(where the policy lets a page go) and `keys` (key tokens as Playwright names them).

Importing this package imports nothing else; import the module you need.
"""
