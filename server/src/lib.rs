//! colibri-server: the OpenAI-compatible HTTP API over the engine.
