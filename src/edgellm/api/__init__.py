"""What an app imports (re-exported by `edgellm`): `loader.load`, the `Model` it returns
(`model.py`), the task presets (`tasks.py`) and the memory planner (`planner.py`)."""
