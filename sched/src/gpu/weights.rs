//! Dense weights on the GPU: each layer's dense tensors (norms, attention,
//! router, shared experts or dense MLP) and the output head packed into one
//! **block** each, resident in VRAM or kept in pinned RAM and streamed into
//! one of two device **stream buffers** as the layer comes up.
//!
//! Streaming: before layer L runs, its block must be in a buffer (copy
//! stream; the compute stream waits for the copy's event); as soon as L is
//! under way, the next streamed block is copied into the other buffer
//! (after the copy stream has waited for the kernels that last read that
//! buffer), so the copy of layer L+1 overlaps the compute of layer L. With
//! one or two streamed blocks they simply stay in their buffers. The bytes
//! the kernels read are the same in either placement, so placement never
//! changes a result.

use colibri_cuda::{
    BufView, CudaDevice, DeviceBuffer, Event, Fp8Scales, HostBuffer, WeightFormat as DevFormat,
    WeightView,
};
use colibri_model::tensor::QMatrix;
use colibri_model::weights::{AttnWeights, DenseWeights, FfnWeights, Linear, MlaQuery, MlpWeights};

use super::{GpuError, cuda_format};

/// Every tensor starts at a multiple of this in its block (any load width).
pub const TENSOR_ALIGN: usize = 256;

/// A matrix inside a block.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MatRef {
    pub off: usize,
    pub bytes: usize,
    pub format: DevFormat,
    pub rows: usize,
    pub cols: usize,
    /// FP8: (offset, f32 count, block).
    pub scales: Option<(usize, usize, usize)>,
}

/// An f32 vector inside a block.
#[derive(Clone, Copy, Debug)]
pub(crate) struct VecRef {
    pub off: usize,
    pub len: usize,
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct LinRef {
    pub w: MatRef,
    pub bias: Option<VecRef>,
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct MlpRef {
    pub gate: MatRef,
    pub up: MatRef,
    pub down: MatRef,
}

#[derive(Clone, Copy, Debug)]
pub(crate) enum MlaQRef {
    Direct(LinRef),
    LowRank { a: LinRef, norm: VecRef, b: LinRef },
}

#[derive(Clone, Copy, Debug)]
pub(crate) enum AttnRef {
    Gqa {
        q: LinRef,
        k: LinRef,
        v: LinRef,
        o: LinRef,
        q_norm: Option<VecRef>,
        k_norm: Option<VecRef>,
    },
    Mla {
        q: MlaQRef,
        kv_a: LinRef,
        kv_a_norm: VecRef,
        kv_b: MatRef,
        o: LinRef,
    },
}

#[derive(Clone, Copy, Debug)]
pub(crate) enum FfnRef {
    Dense(MlpRef),
    Moe {
        router: MatRef,
        shared: Option<MlpRef>,
        shared_gate: Option<MatRef>,
    },
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct LayerRef {
    pub attn_norm: VecRef,
    pub attn: AttnRef,
    pub ffn_norm: VecRef,
    pub ffn: FfnRef,
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct HeadRef {
    pub norm: VecRef,
    pub lm_head: MatRef,
}

impl MatRef {
    /// The matrix in a block whose bytes are `base`.
    pub fn view<'a>(&self, base: BufView<'a, u8>) -> Result<WeightView<'a>, GpuError> {
        let data = base.slice(self.off..self.off + self.bytes)?;
        let fp8 = match self.scales {
            None => None,
            Some((off, len, block)) => Some(Fp8Scales {
                scales: base.slice(off..off + 4 * len)?.cast::<f32>()?,
                block,
            }),
        };
        Ok(WeightView {
            format: self.format,
            rows: self.rows,
            cols: self.cols,
            data,
            fp8,
        })
    }
}

impl VecRef {
    pub fn view<'a>(&self, base: BufView<'a, u8>) -> Result<BufView<'a, f32>, GpuError> {
        Ok(base
            .slice(self.off..self.off + 4 * self.len)?
            .cast::<f32>()?)
    }
}

/// Lays out tensors of one block and remembers where their bytes come from.
struct Packer<'a> {
    bytes: usize,
    parts: Vec<(usize, &'a [u8])>,
}

impl<'a> Packer<'a> {
    fn new() -> Self {
        Packer {
            bytes: 0,
            parts: Vec::new(),
        }
    }

    fn put(&mut self, src: &'a [u8]) -> usize {
        let off = self.bytes.next_multiple_of(TENSOR_ALIGN);
        self.bytes = off + src.len();
        self.parts.push((off, src));
        off
    }

    fn vec(&mut self, v: &'a [f32]) -> VecRef {
        VecRef {
            off: self.put(bytemuck_f32(v)),
            len: v.len(),
        }
    }

    fn mat(&mut self, m: &'a QMatrix) -> Result<MatRef, GpuError> {
        // The device kernels read rows as files store them; the engine
        // puts its CPU layouts back before a GPU tier copies the weights.
        if m.layout() != colibri_model::tensor::Layout::RowMajor {
            return Err(GpuError::Internal(format!(
                "a dense matrix in a CPU layout ({:?}) reached the GPU tier",
                m.layout()
            )));
        }
        let format = cuda_format(m.format)?;
        let off = self.put(m.data().as_slice());
        let scales = match m.scales() {
            None => None,
            Some(s) => {
                let so = self.put(bytemuck_f32(&s.scales));
                Some((so, s.scales.len(), s.block))
            }
        };
        if format == DevFormat::F8E4M3 && scales.is_none() {
            return Err(GpuError::Unsupported("an fp8 matrix without scales".into()));
        }
        Ok(MatRef {
            off,
            bytes: m.stored_bytes(),
            format,
            rows: m.rows,
            cols: m.cols,
            scales,
        })
    }

    fn lin(&mut self, l: &'a Linear) -> Result<LinRef, GpuError> {
        Ok(LinRef {
            w: self.mat(&l.w)?,
            bias: l.bias.as_deref().map(|b| self.vec(b)),
        })
    }

    fn mlp(&mut self, m: &'a MlpWeights) -> Result<MlpRef, GpuError> {
        Ok(MlpRef {
            gate: self.mat(&m.gate)?,
            up: self.mat(&m.up)?,
            down: self.mat(&m.down)?,
        })
    }

    /// The block's bytes (padded so every matrix may be over-read by a
    /// word, as the matvec kernels do).
    fn len(&self) -> usize {
        (self.bytes + 16).next_multiple_of(TENSOR_ALIGN)
    }

    fn fill(&self, dst: &mut [u8]) {
        for &(off, src) in &self.parts {
            dst[off..off + src.len()].copy_from_slice(src);
        }
    }
}

fn bytemuck_f32(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and any byte view of it is valid; the
    // length is the slice's size in bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

fn pack_layer<'a>(
    w: &'a colibri_model::weights::LayerWeights,
) -> Result<(Packer<'a>, LayerRef), GpuError> {
    let mut p = Packer::new();
    let attn_norm = p.vec(&w.attn_norm);
    let ffn_norm = p.vec(&w.ffn_norm);
    let attn = match &w.attn {
        AttnWeights::Gqa(a) => AttnRef::Gqa {
            q: p.lin(&a.q)?,
            k: p.lin(&a.k)?,
            v: p.lin(&a.v)?,
            o: p.lin(&a.o)?,
            q_norm: a.q_norm.as_deref().map(|v| p.vec(v)),
            k_norm: a.k_norm.as_deref().map(|v| p.vec(v)),
        },
        AttnWeights::Mla(a) => AttnRef::Mla {
            q: match &a.q {
                MlaQuery::Direct(l) => MlaQRef::Direct(p.lin(l)?),
                MlaQuery::LowRank { a, norm, b } => MlaQRef::LowRank {
                    a: p.lin(a)?,
                    norm: p.vec(norm),
                    b: p.lin(b)?,
                },
            },
            kv_a: p.lin(&a.kv_a)?,
            kv_a_norm: p.vec(&a.kv_a_norm),
            kv_b: p.mat(&a.kv_b)?,
            o: p.lin(&a.o)?,
        },
    };
    let ffn = match &w.ffn {
        FfnWeights::Dense(m) => FfnRef::Dense(p.mlp(m)?),
        FfnWeights::Moe(m) => FfnRef::Moe {
            router: p.mat(&m.router)?,
            shared: m.shared.as_ref().map(|s| p.mlp(s)).transpose()?,
            shared_gate: m.shared_gate.as_ref().map(|g| p.mat(g)).transpose()?,
        },
    };
    Ok((
        p,
        LayerRef {
            attn_norm,
            attn,
            ffn_norm,
            ffn,
        },
    ))
}

/// The size of every dense block (layers, then the head), for the planner.
pub(crate) fn block_sizes(dense: &DenseWeights) -> Result<Vec<u64>, GpuError> {
    let mut out = Vec::with_capacity(dense.layers.len() + 1);
    for l in &dense.layers {
        out.push(pack_layer(l)?.0.len() as u64);
    }
    let mut p = Packer::new();
    p.vec(&dense.norm);
    p.mat(&dense.lm_head)?;
    out.push(p.len() as u64);
    Ok(out)
}

enum Home {
    Vram(DeviceBuffer<u8>),
    Pinned(HostBuffer),
    /// Another device holds this block (`--devices`).
    Elsewhere,
}

struct StreamBuffer {
    buf: DeviceBuffer<u8>,
    holds: Option<usize>,
    filled: Option<Event>,
    consumed: Option<Event>,
    last_use: u64,
}

/// The dense blocks and their stream buffers.
pub(crate) struct DenseBlocks {
    homes: Vec<Home>,
    pub layers: Vec<LayerRef>,
    pub head: HeadRef,
    streamed: Vec<usize>,
    buffers: Vec<StreamBuffer>,
    /// Which stream buffer serves the block in use.
    current: Option<usize>,
    uses: u64,
    /// Bytes copied host-to-device for streamed blocks.
    pub streamed_bytes: u64,
}

impl DenseBlocks {
    /// Packs every block this device holds (`held`); those with
    /// `resident[i]` go to VRAM, the rest to pinned RAM (copied once, here)
    /// with two stream buffers.
    pub fn load(
        dev: &CudaDevice,
        dense: &DenseWeights,
        resident: &[bool],
        held: &dyn Fn(usize) -> bool,
    ) -> Result<DenseBlocks, GpuError> {
        let mut homes = Vec::with_capacity(dense.layers.len() + 1);
        let mut layers = Vec::with_capacity(dense.layers.len());
        let mut streamed = Vec::new();
        let mut largest_streamed = 0usize;
        let mut place = |i: usize, p: &Packer<'_>| -> Result<Home, GpuError> {
            if !held(i) {
                return Ok(Home::Elsewhere);
            }
            let keep = resident.get(i).copied().unwrap_or(false);
            let mut host = vec![0u8; p.len()];
            Ok(if keep {
                p.fill(&mut host);
                Home::Vram(dev.upload(&host)?)
            } else {
                drop(host);
                let mut h = dev.alloc_host(p.len())?;
                p.fill(h.as_mut_slice());
                streamed.push(i);
                largest_streamed = largest_streamed.max(p.len());
                Home::Pinned(h)
            })
        };
        for (i, l) in dense.layers.iter().enumerate() {
            let (p, r) = pack_layer(l)?;
            homes.push(place(i, &p)?);
            layers.push(r);
        }
        let mut p = Packer::new();
        let norm = p.vec(&dense.norm);
        let lm_head = p.mat(&dense.lm_head)?;
        homes.push(place(dense.layers.len(), &p)?);
        let buffers = if streamed.is_empty() {
            Vec::new()
        } else {
            (0..2.min(streamed.len()))
                .map(|_| {
                    Ok(StreamBuffer {
                        buf: dev.alloc::<u8>(largest_streamed)?,
                        holds: None,
                        filled: None,
                        consumed: None,
                        last_use: 0,
                    })
                })
                .collect::<Result<Vec<_>, GpuError>>()?
        };
        Ok(DenseBlocks {
            homes,
            layers,
            head: HeadRef { norm, lm_head },
            streamed,
            buffers,
            current: None,
            uses: 0,
            streamed_bytes: 0,
        })
    }

    /// The block index of the head.
    pub fn head_block(&self) -> usize {
        self.homes.len() - 1
    }

    fn load_into(&mut self, dev: &CudaDevice, b: usize, block: usize) -> Result<(), GpuError> {
        let Home::Pinned(host) = &self.homes[block] else {
            return Ok(());
        };
        let sb = &mut self.buffers[b];
        if let Some(ev) = &sb.consumed {
            dev.copy_wait(ev)?;
        }
        let len = host.len();
        let dst = sb.buf.view_mut(0..len)?;
        // SAFETY: the pinned block is never written after load and lives as
        // long as `self`; the copy stream waited (above) for the kernels
        // that last read this buffer, and the compute stream waits for
        // `filled` before any kernel reads it again.
        let ev = unsafe { dev.copy_host_ptr_async(host.as_slice().as_ptr(), dst)? };
        sb.filled = Some(ev);
        sb.holds = Some(block);
        self.streamed_bytes += len as u64;
        Ok(())
    }

    /// Makes block `block` ready for the compute stream (and starts copying
    /// the next streamed block).
    pub fn prepare(&mut self, dev: &CudaDevice, block: usize) -> Result<(), GpuError> {
        self.current = None;
        match self.homes[block] {
            Home::Vram(_) => return Ok(()),
            Home::Elsewhere => {
                return Err(GpuError::Internal(format!(
                    "dense block {block} is another device's"
                )));
            }
            Home::Pinned(_) => {}
        }
        let b = match self.buffers.iter().position(|s| s.holds == Some(block)) {
            Some(b) => b,
            None => {
                let b = (0..self.buffers.len())
                    .min_by_key(|&i| self.buffers[i].last_use)
                    .ok_or_else(|| GpuError::Internal("no stream buffer".into()))?;
                self.load_into(dev, b, block)?;
                b
            }
        };
        if let Some(ev) = &self.buffers[b].filled {
            dev.compute_wait(ev)?;
        }
        self.uses += 1;
        self.buffers[b].last_use = self.uses;
        self.current = Some(b);
        // Overlap: the next streamed block goes into the other buffer now.
        if self.buffers.len() > 1
            && let Some(at) = self.streamed.iter().position(|&s| s == block)
        {
            let next = self.streamed[(at + 1) % self.streamed.len()];
            if self.buffers.iter().all(|s| s.holds != Some(next)) {
                self.load_into(dev, 1 - b, next)?;
            }
        }
        Ok(())
    }

    /// The bytes of block `block` (after [`Self::prepare`]).
    pub fn view(&self, block: usize) -> Result<BufView<'_, u8>, GpuError> {
        match &self.homes[block] {
            Home::Vram(buf) => Ok(buf.as_view()),
            Home::Elsewhere => Err(GpuError::Internal(format!(
                "dense block {block} is another device's"
            ))),
            Home::Pinned(_) => {
                let b = self
                    .current
                    .filter(|&b| self.buffers[b].holds == Some(block))
                    .ok_or_else(|| GpuError::Internal(format!("block {block} is not prepared")))?;
                Ok(self.buffers[b].buf.as_view())
            }
        }
    }

    /// Block `block`'s bytes if they live in this device's VRAM (not
    /// streamed, not another device's).
    pub fn vram_view(&self, block: usize) -> Option<BufView<'_, u8>> {
        match self.homes.get(block) {
            Some(Home::Vram(buf)) => Some(buf.as_view()),
            _ => None,
        }
    }

    /// The kernels reading block `block` are all issued.
    pub fn finish(&mut self, dev: &CudaDevice) -> Result<(), GpuError> {
        if let Some(b) = self.current.take() {
            self.buffers[b].consumed = Some(dev.record_compute()?);
        }
        Ok(())
    }

    /// Whether every block of this device lives in VRAM (nothing streams).
    pub fn all_resident(&self) -> bool {
        self.homes
            .iter()
            .all(|h| matches!(h, Home::Vram(_) | Home::Elsewhere))
    }

    /// Blocks in VRAM, of all.
    pub fn resident_count(&self) -> usize {
        self.homes
            .iter()
            .filter(|h| matches!(h, Home::Vram(_)))
            .count()
    }
}
