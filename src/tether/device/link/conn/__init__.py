"""The parts `DeviceConnection` (`tether.device.link.connection`) is made of: registering, the reader of
server frames, and the registered link's sender and heartbeat."""
