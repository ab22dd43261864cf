"""What benches and tests both start: real engines (engines.py: a private PostgreSQL or Redis), a scripted
Chat Completions server (fake_llm.py: FakeLLM) and the Tk program the desktop tools drive (gui_app.py, run
by path), the real processes the benches run (procs/), and a minimal raw HTTP/1.1 client (raw_http.py). It
imports nothing from tests/."""
