//! colibri-sched: the engine.
