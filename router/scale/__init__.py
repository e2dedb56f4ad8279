"""Scale-out: several worker processes on one host (workers, worker_sync, shared) and several router hosts
through Redis (fleet_view)."""
