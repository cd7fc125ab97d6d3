//! colibri-io: the disk path. It knows nothing of models: it reads byte
//! extents of files into page-locked buffers as fast as the drive allows.
