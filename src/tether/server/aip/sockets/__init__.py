"""The device socket: the transport adapter, one link's writes, the judgement of a registration, a
connection's admission and its frames."""
