"""Native CPU kernels (C++ built once per machine by build.py, loaded with ctypes) and their Python bindings.

The engine reaches them through engine/cpu_kernels.py; nothing here imports the engine.
"""
