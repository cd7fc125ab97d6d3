//! The attention block of the GPU forward pass: projections, q/k norms,
//! rotary embedding, KV append and attention per sequence, for GQA and
//! MLA (absorbed, or the fallback of `mla_needs_fallback`).

use super::*;

/// Attention of one sequence's rows: split over several blocks per (row,
/// head) for a pass of few rows (the same bits either way). `out_q8`: the
/// output's Q8 rows as well (the split launch only: a pass of few rows).
fn attend(
    k: &KernelSet,
    dev: &CudaDevice,
    at: &Attention<'_>,
    s: &mut SplitScratch,
    out: BufMut<'_, f32>,
    out_q8: Option<BufMut<'_, u8>>,
) -> Result<(), GpuError> {
    if at.rows > SPLIT_ROWS {
        if out_q8.is_some() {
            return Err(GpuError::Internal("Q8 rows of a many-row attention".into()));
        }
        return Ok(k.attention(dev, at, out)?);
    }
    let split = AttentionSplit {
        blocks: SPLIT_BLOCKS.min(s.chunks),
        chunk_cap: s.chunks,
        records: s.records.as_mut(),
        counters: s.counters.as_mut(),
        out_q8,
    };
    Ok(k.attention_split(dev, at, split, out)?)
}

impl State {
    pub(super) fn attention(
        &mut self,
        model: &Model,
        l: usize,
        n: usize,
        parts: &mut [Part<'_>],
        starts: &[usize],
        attn: &AttnRef,
    ) -> Result<(), GpuError> {
        match (*attn, self.dims.attn) {
            (
                AttnRef::Gqa {
                    q,
                    k,
                    v,
                    o,
                    q_norm,
                    k_norm,
                },
                AttnDims::Gqa {
                    nh,
                    nkv,
                    hd,
                    qk_norm,
                    clip,
                    scale,
                },
            ) => self.gqa(
                model,
                l,
                n,
                parts,
                starts,
                [q, k, v, o],
                q_norm,
                k_norm,
                (nh, nkv, hd, qk_norm, clip, scale),
            ),
            (
                AttnRef::Mla {
                    q,
                    kv_a,
                    kv_a_norm,
                    kv_b,
                    o,
                },
                AttnDims::Mla {
                    nh,
                    r,
                    dn,
                    dr,
                    dv,
                    scale,
                    ..
                },
            ) => self.mla(
                l,
                n,
                parts,
                starts,
                q,
                kv_a,
                kv_a_norm,
                kv_b,
                o,
                (nh, r, dn, dr, dv, scale),
            ),
            _ => Err(GpuError::Internal(
                "attention weights do not match the spec".into(),
            )),
        }
    }

    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn gqa(
        &mut self,
        model: &Model,
        l: usize,
        n: usize,
        parts: &mut [Part<'_>],
        starts: &[usize],
        [wq, wk, wv, wo]: [LinRef; 4],
        q_norm: Option<VecRef>,
        k_norm: Option<VecRef>,
        (nh, nkv, hd, qk_norm, clip, scale): (usize, usize, usize, QkNorm, Option<f32>, f32),
    ) -> Result<(), GpuError> {
        let dims = self.dims;
        let (qd, kvd) = (nh * hd, nkv * hd);
        let eps = dims.eps;
        let base = self.dense.view(l)?;
        let h = self.s.h.view(0..n * dims.hidden)?;
        let (w_q, w_k, w_v) = (wq.w.view(base)?, wk.w.view(base)?, wv.w.view(base)?);
        let w_o = wo.w.view(base)?;
        // One token whose output projection takes 8-bit activations: the
        // attention quantizes its output once, for that product to copy.
        let ctx_q8 = n == 1
            && self.k.q8_once()
            && hd.is_multiple_of(32)
            && w_o.format.storage() != w_o.format;
        if n == 1 && w_q.format == w_k.format && w_q.format == w_v.format {
            // One token: the three projections in one launch (the same
            // arithmetic per matrix as three), then any biases.
            self.k.matvec_seg(
                &self.dev,
                h,
                vec![
                    (w_q, self.s.q.view_mut(0..qd)?),
                    (w_k, self.s.k.view_mut(0..kvd)?),
                    (w_v, self.s.v.view_mut(0..kvd)?),
                ],
            )?;
            for (l, y, len) in [
                (&wq, &mut self.s.q, qd),
                (&wk, &mut self.s.k, kvd),
                (&wv, &mut self.s.v, kvd),
            ] {
                if let Some(b) = &l.bias {
                    self.k
                        .add_bias(&self.dev, y.view_mut(0..len)?, b.view(base)?, 1)?;
                }
            }
        } else {
            for (l, y, len) in [
                (&wq, &mut self.s.q, qd),
                (&wk, &mut self.s.k, kvd),
                (&wv, &mut self.s.v, kvd),
            ] {
                linear(&self.dev, &self.k, base, l, h, n, y.view_mut(0..n * len)?)?;
            }
        }
        let norm_w = |r: Option<VecRef>| -> Result<BufView<'_, f32>, GpuError> {
            r.ok_or_else(|| GpuError::Internal("q/k norm weights missing".into()))?
                .view(base)
        };
        let window = model.spec.layers[l].sliding_window;
        let table = self.rope.table();
        // Per-head norms, rotary embedding and the KV append in one launch
        // per sequence (the same operations as the separate kernels below).
        let fused = clip.is_none() && matches!(qk_norm, QkNorm::None | QkNorm::PerHead);
        if fused {
            let (qn, kn) = match qk_norm {
                QkNorm::PerHead => (Some(norm_w(q_norm)?), Some(norm_w(k_norm)?)),
                _ => (None, None),
            };
            for (p, &r0) in parts.iter_mut().zip(starts) {
                let m = p.tokens.len();
                let kv = kv::attached(p.cache, self.kv_shape.stage)?;
                let cap = kv.capacity();
                let (kc, vc) = kv.parts_mut(l)?;
                self.k.gqa_prep(
                    &self.dev,
                    self.s.q.view_mut(r0 * qd..(r0 + m) * qd)?,
                    self.s.k.view_mut(r0 * kvd..(r0 + m) * kvd)?,
                    self.s.v.view(r0 * kvd..(r0 + m) * kvd)?,
                    m,
                    (nh, nkv, hd),
                    qn,
                    kn,
                    eps,
                    &table,
                    self.s.pos.view(r0..r0 + m)?,
                    self.s.slot0.view(0..m)?,
                    kc,
                    vc,
                    cap,
                )?;
            }
        } else {
            match qk_norm {
                QkNorm::None => {}
                QkNorm::PerHead => {
                    self.k.rms_norm_inplace(
                        &self.dev,
                        self.s.q.view_mut(0..n * qd)?,
                        norm_w(q_norm)?,
                        n * nh,
                        hd,
                        eps,
                    )?;
                    self.k.rms_norm_inplace(
                        &self.dev,
                        self.s.k.view_mut(0..n * kvd)?,
                        norm_w(k_norm)?,
                        n * nkv,
                        hd,
                        eps,
                    )?;
                }
                QkNorm::Full => {
                    self.k.rms_norm_inplace(
                        &self.dev,
                        self.s.q.view_mut(0..n * qd)?,
                        norm_w(q_norm)?,
                        n,
                        qd,
                        eps,
                    )?;
                    self.k.rms_norm_inplace(
                        &self.dev,
                        self.s.k.view_mut(0..n * kvd)?,
                        norm_w(k_norm)?,
                        n,
                        kvd,
                        eps,
                    )?;
                }
            }
            if let Some(c) = clip {
                self.k
                    .clamp_inplace(&self.dev, self.s.q.view_mut(0..n * qd)?, c)?;
                self.k
                    .clamp_inplace(&self.dev, self.s.k.view_mut(0..n * kvd)?, c)?;
                self.k
                    .clamp_inplace(&self.dev, self.s.v.view_mut(0..n * kvd)?, c)?;
            }
            let pos = self.s.pos.view(0..n)?;
            self.k.rope(
                &self.dev,
                self.s.q.view_mut(0..n * qd)?,
                n,
                nh,
                qd,
                hd,
                0,
                &table,
                pos,
            )?;
            self.k.rope(
                &self.dev,
                self.s.k.view_mut(0..n * kvd)?,
                n,
                nkv,
                kvd,
                hd,
                0,
                &table,
                pos,
            )?;
        }
        for (p, &r0) in parts.iter_mut().zip(starts) {
            let m = p.tokens.len();
            let kv = kv::attached(p.cache, self.kv_shape.stage)?;
            let cap = kv.capacity();
            // Appended at the rows' device-side positions (len + i), so a
            // captured step appends at the right place on every replay.
            if !fused {
                for (part, src) in [(0, &self.s.k), (1, &self.s.v)] {
                    self.k.kv_append(
                        &self.dev,
                        src.view(r0 * kvd..(r0 + m) * kvd)?,
                        kvd,
                        kv.part_mut(l, part)?,
                        kvd,
                        cap,
                        m,
                        kvd,
                        self.s.pos.view(r0..r0 + m)?,
                        self.s.slot0.view(0..m)?,
                    )?;
                }
            }
            let at = Attention {
                q: self.s.q.view(r0 * qd..(r0 + m) * qd)?,
                rows: m,
                heads: nh,
                dim_a: hd,
                dim_b: 0,
                dim_v: hd,
                group: nh / nkv,
                key_a: KvView {
                    data: kv.part(l, 0)?,
                    slot_stride: kvd,
                    head_stride: hd,
                },
                key_b: None,
                value: KvView {
                    data: kv.part(l, 1)?,
                    slot_stride: kvd,
                    head_stride: hd,
                },
                capacity: kv.capacity(),
                pos: self.s.pos.view(r0..r0 + m)?,
                slot0: self.s.slot0.view(0..m)?,
                window,
                scale,
            };
            attend(
                &self.k,
                &self.dev,
                &at,
                &mut self.s.split,
                self.s.ctx.view_mut(r0 * qd..(r0 + m) * qd)?,
                if ctx_q8 {
                    Some(self.s.ctxq.view_mut(0..q8_row_bytes(qd))?)
                } else {
                    None
                },
            )?;
        }
        if ctx_q8 {
            // One token: the output projection copies the attention's
            // quants of its input (the same bits as quantizing it again).
            self.k.matvec_from_q8(
                &self.dev,
                &w_o,
                self.s.ctx.view(0..qd)?,
                self.s.ctxq.view(0..q8_row_bytes(qd))?,
                self.s.a.view_mut(0..dims.hidden)?,
            )?;
            if let Some(b) = &wo.bias {
                self.k.add_bias(
                    &self.dev,
                    self.s.a.view_mut(0..dims.hidden)?,
                    b.view(base)?,
                    1,
                )?;
            }
            return Ok(());
        }
        linear(
            &self.dev,
            &self.k,
            base,
            &wo,
            self.s.ctx.view(0..n * qd)?,
            n,
            self.s.a.view_mut(0..n * dims.hidden)?,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn mla(
        &mut self,
        l: usize,
        n: usize,
        parts: &mut [Part<'_>],
        starts: &[usize],
        q: MlaQRef,
        kv_a: LinRef,
        kv_a_norm: VecRef,
        kv_b: MatRef,
        o: LinRef,
        (nh, r, dn, dr, dv, scale): (usize, usize, usize, usize, usize, f32),
    ) -> Result<(), GpuError> {
        let dims = self.dims;
        let qk = dn + dr;
        let qw = nh * qk;
        let base = self.dense.view(l)?;
        let h = self.s.h.view(0..n * dims.hidden)?;
        match q {
            MlaQRef::Direct(w) => linear(
                &self.dev,
                &self.k,
                base,
                &w,
                h,
                n,
                self.s.q.view_mut(0..n * qw)?,
            )?,
            MlaQRef::LowRank { a, norm, b } => {
                let ql = a.w.rows;
                linear(
                    &self.dev,
                    &self.k,
                    base,
                    &a,
                    h,
                    n,
                    self.s.ql.view_mut(0..n * ql)?,
                )?;
                self.k.rms_norm_inplace(
                    &self.dev,
                    self.s.ql.view_mut(0..n * ql)?,
                    norm.view(base)?,
                    n,
                    ql,
                    MLA_LORA_NORM_EPS,
                )?;
                linear(
                    &self.dev,
                    &self.k,
                    base,
                    &b,
                    self.s.ql.view(0..n * ql)?,
                    n,
                    self.s.q.view_mut(0..n * qw)?,
                )?;
            }
        }
        let cw = r + dr;
        linear(
            &self.dev,
            &self.k,
            base,
            &kv_a,
            h,
            n,
            self.s.ckv.view_mut(0..n * cw)?,
        )?;
        self.k.rms_norm_strided_inplace(
            &self.dev,
            self.s.ckv.view_mut(0..n * cw)?,
            cw,
            kv_a_norm.view(base)?,
            n,
            r,
            MLA_LORA_NORM_EPS,
        )?;
        let table = self.rope.table();
        let pos = self.s.pos.view(0..n)?;
        self.k.rope(
            &self.dev,
            self.s.ckv.view_mut(0..n * cw)?,
            n,
            1,
            cw,
            cw,
            r,
            &table,
            pos,
        )?;
        self.k.rope(
            &self.dev,
            self.s.q.view_mut(0..n * qw)?,
            n,
            nh,
            qw,
            qk,
            dn,
            &table,
            pos,
        )?;
        let kv_b_w = kv_b.view(base)?;
        let aw = nh * cw;
        self.k.mla_absorb(
            &self.dev,
            &kv_b_w,
            nh,
            dn,
            dv,
            self.s.q.view(0..n * qw)?,
            qw,
            qk,
            n,
            self.s.qa.view_mut(0..n * aw)?,
            aw,
            cw,
        )?;
        // q_pe beside the absorbed query: qa[row][head] = [absorbed | q_pe].
        self.k.copy_2d(
            &self.dev,
            self.s.q.view(dn..n * qw)?,
            qk,
            self.s.qa.view_mut(r..n * aw)?,
            cw,
            n * nh,
            dr,
        )?;
        let ctxw = nh * r;
        for (p, &r0) in parts.iter_mut().zip(starts) {
            let m = p.tokens.len();
            let kv = kv::attached(p.cache, self.kv_shape.stage)?;
            let cap = kv.capacity();
            self.k.kv_append(
                &self.dev,
                self.s.ckv.view(r0 * cw..(r0 + m) * cw)?,
                cw,
                kv.part_mut(l, 0)?,
                r,
                cap,
                m,
                r,
                self.s.pos.view(r0..r0 + m)?,
                self.s.slot0.view(0..m)?,
            )?;
            self.k.kv_append(
                &self.dev,
                self.s.ckv.view(r0 * cw + r..(r0 + m) * cw)?,
                cw,
                kv.part_mut(l, 1)?,
                dr,
                cap,
                m,
                dr,
                self.s.pos.view(r0..r0 + m)?,
                self.s.slot0.view(0..m)?,
            )?;
            let at = Attention {
                q: self.s.qa.view(r0 * aw..(r0 + m) * aw)?,
                rows: m,
                heads: nh,
                dim_a: r,
                dim_b: dr,
                dim_v: r,
                group: nh,
                key_a: KvView {
                    data: kv.part(l, 0)?,
                    slot_stride: r,
                    head_stride: 0,
                },
                key_b: Some(KvView {
                    data: kv.part(l, 1)?,
                    slot_stride: dr,
                    head_stride: 0,
                }),
                value: KvView {
                    data: kv.part(l, 0)?,
                    slot_stride: r,
                    head_stride: 0,
                },
                capacity: kv.capacity(),
                pos: self.s.pos.view(r0..r0 + m)?,
                slot0: self.s.slot0.view(0..m)?,
                window: None,
                scale,
            };
            attend(
                &self.k,
                &self.dev,
                &at,
                &mut self.s.split,
                self.s.ctx.view_mut(r0 * ctxw..(r0 + m) * ctxw)?,
                None,
            )?;
        }
        // W_uv per head: rows h·(dn+dv)+dn .. +dv of kv_b on the head's
        // attended latent.
        let mow = nh * dv;
        if !self.mla_fallback {
            let rb = kv_b_w
                .format
                .row_bytes(r)
                .ok_or_else(|| GpuError::Internal("kv_b rows".into()))?;
            let fp8 = match kv_b_w.fp8 {
                None => None,
                Some(s) => {
                    let gc = r.div_ceil(s.block);
                    Some(colibri_cuda::Fp8Scales {
                        scales: s.scales.slice((dn / s.block) * gc..s.scales.len())?,
                        block: s.block,
                    })
                }
            };
            let w = WeightView {
                format: kv_b_w.format,
                rows: dv,
                cols: r,
                data: kv_b_w.data.slice(dn * rb..kv_b_w.data.len())?,
                fp8,
            };
            let scale_stride = kv_b_w
                .fp8
                .map_or(0, |s| ((dn + dv) / s.block) * r.div_ceil(s.block));
            self.k.matvec_group(
                &self.dev,
                &MatvecGroup {
                    w,
                    matrices: nh,
                    w_stride: (dn + dv) * rb,
                    scale_stride,
                    x: self.s.ctx.view(0..n * ctxw)?,
                    x_tok_stride: ctxw,
                    x_mat_stride: r,
                    ntok: n,
                    y_tok_stride: mow,
                    y_mat_stride: dv,
                },
                self.s.mo.view_mut(0..n * mow)?,
            )?;
        } else {
            let full = nh * (dn + dv);
            for head in 0..nh {
                self.k.matvec_group(
                    &self.dev,
                    &MatvecGroup {
                        w: kv_b_w,
                        matrices: 1,
                        w_stride: 0,
                        scale_stride: 0,
                        x: self.s.ctx.view(head * r..n * ctxw)?,
                        x_tok_stride: ctxw,
                        x_mat_stride: 0,
                        ntok: n,
                        y_tok_stride: full,
                        y_mat_stride: 0,
                    },
                    self.s.mtmp.view_mut(0..n * full)?,
                )?;
                let from = head * (dn + dv) + dn;
                self.k.copy_2d(
                    &self.dev,
                    self.s.mtmp.view(from..n * full)?,
                    full,
                    self.s.mo.view_mut(head * dv..n * mow)?,
                    mow,
                    n,
                    dv,
                )?;
            }
        }
        let base = self.dense.view(l)?;
        linear(
            &self.dev,
            &self.k,
            base,
            &o,
            self.s.mo.view(0..n * mow)?,
            n,
            self.s.a.view_mut(0..n * dims.hidden)?,
        )
    }
}
