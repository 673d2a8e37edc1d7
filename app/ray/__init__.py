"""Data-parallel replicas on Ray Serve (`sluice serve --data-parallel-backend ray`).

Imported only when that backend is chosen: nothing else in sluice imports `ray`.

- `replica.py`: one replica, a full sluice engine (its own core process), as a Serve deployment class.
- `engine.py`: `RayEngine`, the engine the OpenAI app (`app/server/app.py`) talks to: it tokenizes, then streams
  each request from a replica through a Serve handle.
- `routers.py`: the request routers (`kv`, `prefix`, `least-loaded`, `round-robin`), on Serve's
  `RequestRouter` API; `kv_index.py`: the replicas' cached blocks, rebuilt from their KV events; `policy.py`:
  the decisions and each replica's `CacheView`, shared with `sluice cache-sim --replicas`; `route_trace.py`:
  each `kv` decision beside the hit the replica got (`bench.py --trace`).
- `request.py`: what crosses from the front end to a replica; the session id of the HTTP request.
"""
