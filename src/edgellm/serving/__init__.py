"""Serving: one loaded model shared by many requests. `service.py` owns the queue and the engine
loop, `scheduler.py` decides each step (pure policy), `engine.py` runs it, `handle.py` is what a
caller holds for one request, `session.py` one conversation; `thermal.py` and `profile.py` (with
the built-in device profiles in `profiles/`) set the limits it runs within."""
