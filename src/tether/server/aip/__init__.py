"""The server end of AIP: the hub (one socket per device), the ledger of batches, the dispatcher,
fan-out, registration, the device registry and liveness; and what the server asks of devices over it:
a device's policy (`policy_push`) and files sent between devices (`transfer/`). Import the modules
themselves (`tether.server.aip.hub`, …); this package imports nothing."""
