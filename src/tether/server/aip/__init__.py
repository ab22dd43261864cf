"""The server end of AIP: the hub (one socket per device), the ledger of batches, the dispatcher,
fan-out, registration, the device registry and liveness. Import the modules themselves
(`tether.server.aip.hub`, …); this package imports nothing."""
