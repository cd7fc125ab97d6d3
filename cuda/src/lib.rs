//! colibri-cuda: the GPU tier. It depends on no other crate of colibri's:
//! the engine calls in, nothing calls out.
