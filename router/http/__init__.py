"""The router's own HTTP/1.1 stack: the lean listener (server), the lean client (client), the aiohttp listener,
connection limits, the transports the proxy streams through, and the C request and response heads (_fasthttp)."""
