"""What benches and tests both start: real engines (engines.py: a private PostgreSQL or Redis), a scripted
Chat Completions server (fake_llm.py: FakeLLM) and the Tk program the desktop tools drive (gui_app.py, run
by path), and the real processes the benches run (procs/). It imports nothing from tests/."""
