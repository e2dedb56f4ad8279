"""Small fault-injecting fake upstreams for fast router tests (loopback only)."""
