"""The device's AIP link to a server: connection, outbox, reconnect, keep-alive, batches, enrolment, TLS pin."""
