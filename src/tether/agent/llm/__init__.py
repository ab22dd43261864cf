"""The LLM: which one and how to call it (`settings`), the Chat Completions client (`chat`), JSON schemas
as llama.cpp grammars (`grammar`), and devices' sampling requests answered by the server's LLM (`sampling`)."""
