//! The GGUF header: magic, version, metadata key/values (every value type,
//! arrays included), tensor infos, alignment and the data offset, parsed
//! from the bytes of a whole file.
//!
//! Layout (little-endian, versions 2 and 3):
//! `"GGUF"`, u32 version, u64 tensor count, u64 metadata count, then the
//! key/values (`string key, u32 type, value`), then the tensor infos
//! (`string name, u32 n_dims, u64 ne[n_dims], u32 ggml type, u64 offset`),
//! padding to `general.alignment` (default 32), and the tensor data.
//! Strings are `u64 length + UTF-8 bytes`; arrays are `u32 element type,
//! u64 count, elements`.
//!
//! The parser never trusts a count or a length: each is checked against
//! the bytes that remain before anything is allocated, so a corrupt or
//! truncated file gives an error naming the field or tensor, never a panic
//! or a huge allocation.

use std::collections::HashMap;

/// Default `general.alignment`.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Nesting depth allowed for arrays of arrays.
const MAX_ARRAY_DEPTH: usize = 4;
/// ggml tensors have at most four dimensions.
pub const MAX_DIMS: usize = 4;

/// The type tag of a metadata value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgufType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl GgufType {
    pub fn from_u32(v: u32) -> Option<GgufType> {
        use GgufType::*;
        Some(match v {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    pub fn to_u32(self) -> u32 {
        use GgufType::*;
        match self {
            U8 => 0,
            I8 => 1,
            U16 => 2,
            I16 => 3,
            U32 => 4,
            I32 => 5,
            F32 => 6,
            Bool => 7,
            String => 8,
            Array => 9,
            U64 => 10,
            I64 => 11,
            F64 => 12,
        }
    }

    /// The fewest bytes one value of this type takes (for capping counts).
    fn min_size(self) -> usize {
        use GgufType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }
}

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(GgufArray),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// An array value: its element type and elements (all of that type).
#[derive(Clone, Debug, PartialEq)]
pub struct GgufArray {
    pub elem: GgufType,
    pub values: Vec<GgufValue>,
}

impl GgufValue {
    pub fn ty(&self) -> GgufType {
        match self {
            GgufValue::U8(_) => GgufType::U8,
            GgufValue::I8(_) => GgufType::I8,
            GgufValue::U16(_) => GgufType::U16,
            GgufValue::I16(_) => GgufType::I16,
            GgufValue::U32(_) => GgufType::U32,
            GgufValue::I32(_) => GgufType::I32,
            GgufValue::F32(_) => GgufType::F32,
            GgufValue::Bool(_) => GgufType::Bool,
            GgufValue::String(_) => GgufType::String,
            GgufValue::Array(_) => GgufType::Array,
            GgufValue::U64(_) => GgufType::U64,
            GgufValue::I64(_) => GgufType::I64,
            GgufValue::F64(_) => GgufType::F64,
        }
    }

    /// The value as an unsigned integer, if it is a non-negative integer of
    /// any width (writers differ in the width they pick).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v as u64),
            GgufValue::U16(v) => Some(v as u64),
            GgufValue::U32(v) => Some(v as u64),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, if it is a float or an integer.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v as f64),
            GgufValue::F64(v) => Some(v),
            GgufValue::I8(v) => Some(v as f64),
            GgufValue::I16(v) => Some(v as f64),
            GgufValue::I32(v) => Some(v as f64),
            GgufValue::I64(v) => Some(v as f64),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&GgufArray> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// The ggml tensor types: id, name, elements per block, bytes per block.
/// Every type is listed so that any valid file's tensors can be bounds
/// checked; which ones colibri computes with is decided by the loader.
const GGML_TYPES: &[(u32, &str, u64, u64)] = &[
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (9, "Q8_1", 32, 36),
    (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
    (15, "Q8_K", 256, 292),
    (16, "IQ2_XXS", 256, 66),
    (17, "IQ2_XS", 256, 74),
    (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50),
    (20, "IQ4_NL", 32, 18),
    (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82),
    (23, "IQ4_XS", 256, 136),
    (24, "I8", 1, 1),
    (25, "I16", 1, 2),
    (26, "I32", 1, 4),
    (27, "I64", 1, 8),
    (28, "F64", 1, 8),
    (29, "IQ1_M", 256, 56),
    (30, "BF16", 1, 2),
    (34, "TQ1_0", 256, 54),
    (35, "TQ2_0", 256, 66),
    (39, "MXFP4", 32, 17),
];

/// A ggml tensor type id known to the table above.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GgmlType(u32);

impl GgmlType {
    pub const F32: GgmlType = GgmlType(0);
    pub const F16: GgmlType = GgmlType(1);
    pub const Q4_0: GgmlType = GgmlType(2);
    pub const Q4_1: GgmlType = GgmlType(3);
    pub const Q5_0: GgmlType = GgmlType(6);
    pub const Q5_1: GgmlType = GgmlType(7);
    pub const Q8_0: GgmlType = GgmlType(8);
    pub const Q2_K: GgmlType = GgmlType(10);
    pub const Q3_K: GgmlType = GgmlType(11);
    pub const Q4_K: GgmlType = GgmlType(12);
    pub const Q5_K: GgmlType = GgmlType(13);
    pub const Q6_K: GgmlType = GgmlType(14);
    pub const IQ4_NL: GgmlType = GgmlType(20);
    pub const IQ4_XS: GgmlType = GgmlType(23);
    pub const BF16: GgmlType = GgmlType(30);

    pub fn from_id(id: u32) -> Option<GgmlType> {
        GGML_TYPES.iter().any(|t| t.0 == id).then_some(GgmlType(id))
    }

    fn entry(self) -> (u32, &'static str, u64, u64) {
        // `GgmlType` values only come from the table (or its constants).
        *GGML_TYPES
            .iter()
            .find(|t| t.0 == self.0)
            .unwrap_or(&GGML_TYPES[0])
    }

    pub fn id(self) -> u32 {
        self.0
    }

    pub fn name(self) -> &'static str {
        self.entry().1
    }

    pub fn block_size(self) -> u64 {
        self.entry().2
    }

    pub fn block_bytes(self) -> u64 {
        self.entry().3
    }

    /// Bytes of a tensor of dims `ne` (ggml order), or why it is invalid.
    pub fn tensor_bytes(self, ne: &[u64]) -> Result<u64, String> {
        let ne0 = ne.first().copied().unwrap_or(1);
        if !ne0.is_multiple_of(self.block_size()) {
            return Err(format!(
                "first dimension {ne0} is not a multiple of the {}-element {} block",
                self.block_size(),
                self.name()
            ));
        }
        let mut elems: u64 = 1;
        for &d in ne {
            elems = elems
                .checked_mul(d)
                .ok_or_else(|| format!("dimensions {ne:?} overflow"))?;
        }
        (elems / self.block_size())
            .checked_mul(self.block_bytes())
            .ok_or_else(|| format!("dimensions {ne:?} overflow"))
    }
}

/// One tensor's description.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions in ggml order: `ne[0]` is the innermost (a row's length).
    pub ne: Vec<u64>,
    pub ty: GgmlType,
    /// Offset from the start of the data section.
    pub offset: u64,
    /// Bytes the tensor occupies.
    pub size: u64,
}

/// A parsed header.
#[derive(Clone, Debug)]
pub struct GgufHeader {
    pub version: u32,
    /// Metadata in file order.
    pub metadata: Vec<(String, GgufValue)>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_offset: u64,
    index: HashMap<String, usize>,
    meta_index: HashMap<String, usize>,
}

impl GgufHeader {
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8], String> {
        if n > self.remaining() {
            return Err(format!(
                "{}: needs {n} bytes at offset {}, the file ends after {} more (truncated?)",
                what(),
                self.pos,
                self.remaining()
            ));
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], String> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count of items of at least `min_size` bytes each, capped by what
    /// is left of the file.
    fn count(&mut self, min_size: usize, what: &dyn Fn() -> String) -> Result<usize, String> {
        let n = self.u64(what)?;
        let cap = (self.remaining() / min_size.max(1)) as u64;
        if n > cap {
            return Err(format!(
                "{}: count {n} cannot fit in the {} bytes left of the file",
                what(),
                self.remaining()
            ));
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, String> {
        let len = self.count(1, what)?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| format!("{}: not valid UTF-8", what()))
    }

    fn value(
        &mut self,
        ty: GgufType,
        depth: usize,
        what: &dyn Fn() -> String,
    ) -> Result<GgufValue, String> {
        Ok(match ty {
            GgufType::U8 => GgufValue::U8(self.array::<1>(what)?[0]),
            GgufType::I8 => GgufValue::I8(self.array::<1>(what)?[0] as i8),
            GgufType::U16 => GgufValue::U16(u16::from_le_bytes(self.array(what)?)),
            GgufType::I16 => GgufValue::I16(i16::from_le_bytes(self.array(what)?)),
            GgufType::U32 => GgufValue::U32(self.u32(what)?),
            GgufType::I32 => GgufValue::I32(i32::from_le_bytes(self.array(what)?)),
            GgufType::F32 => GgufValue::F32(f32::from_le_bytes(self.array(what)?)),
            GgufType::U64 => GgufValue::U64(self.u64(what)?),
            GgufType::I64 => GgufValue::I64(i64::from_le_bytes(self.array(what)?)),
            GgufType::F64 => GgufValue::F64(f64::from_le_bytes(self.array(what)?)),
            GgufType::Bool => match self.array::<1>(what)?[0] {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => return Err(format!("{}: bool byte {b} is neither 0 nor 1", what())),
            },
            GgufType::String => GgufValue::String(self.string(what)?),
            GgufType::Array => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(format!(
                        "{}: arrays nested deeper than {MAX_ARRAY_DEPTH}",
                        what()
                    ));
                }
                let t = self.u32(what)?;
                let elem = GgufType::from_u32(t)
                    .ok_or_else(|| format!("{}: unknown array element type {t}", what()))?;
                let n = self.count(elem.min_size(), what)?;
                let mut values = Vec::with_capacity(n);
                for _ in 0..n {
                    values.push(self.value(elem, depth + 1, what)?);
                }
                GgufValue::Array(GgufArray { elem, values })
            }
        })
    }
}

/// Parses the header of a GGUF file whose whole contents are `bytes`.
/// Errors name the field or tensor at fault (the caller adds the file).
pub fn parse(bytes: &[u8]) -> Result<GgufHeader, String> {
    let mut c = Cursor { bytes, pos: 0 };
    let magic = c.take(4, &|| "magic".into())?;
    if magic != b"GGUF" {
        return Err(format!(
            "not a GGUF file (magic {magic:02x?}, expected \"GGUF\")"
        ));
    }
    let version = c.u32(&|| "version".into())?;
    match version {
        2 | 3 => {}
        1 => {
            return Err(
                "GGUF version 1 (32-bit counts) is not supported; re-convert the model".into(),
            );
        }
        v if v != 0 && v.swap_bytes() <= 3 => {
            return Err("big-endian GGUF files are not supported".into());
        }
        v => return Err(format!("unsupported GGUF version {v} (supported: 2, 3)")),
    }
    // A tensor info takes at least 8 (name) + 4 + 8 (one dim) + 4 + 8 bytes,
    // a key/value at least 8 (key) + 4 + 1.
    let n_tensors = c.count(32, &|| "tensor count".into())?;
    let n_kv = c.count(13, &|| "metadata count".into())?;

    let mut metadata = Vec::with_capacity(n_kv);
    let mut meta_index = HashMap::with_capacity(n_kv);
    for i in 0..n_kv {
        let key = c.string(&|| format!("metadata key #{i}"))?;
        let what = || format!("metadata `{key}`");
        let t = c.u32(&what)?;
        let ty =
            GgufType::from_u32(t).ok_or_else(|| format!("{}: unknown value type {t}", what()))?;
        let value = c.value(ty, 0, &what)?;
        if meta_index.insert(key.clone(), metadata.len()).is_some() {
            return Err(format!("metadata `{key}` appears twice"));
        }
        metadata.push((key, value));
    }

    let alignment = match meta_index.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(&i) => match metadata[i].1 {
            GgufValue::U32(a) if a > 0 && a.is_power_of_two() => a as u64,
            ref v => {
                return Err(format!(
                    "metadata `general.alignment`: {v:?} is not a power-of-two u32"
                ));
            }
        },
    };

    let mut tensors = Vec::with_capacity(n_tensors);
    let mut index = HashMap::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let name = c.string(&|| format!("tensor info #{i} name"))?;
        let what = || format!("tensor `{name}`");
        let n_dims = c.u32(&what)? as usize;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(format!(
                "{}: {n_dims} dimensions (1..={MAX_DIMS} allowed)",
                what()
            ));
        }
        let mut ne = Vec::with_capacity(n_dims);
        for _ in 0..n_dims {
            ne.push(c.u64(&what)?);
        }
        let t = c.u32(&what)?;
        let ty =
            GgmlType::from_id(t).ok_or_else(|| format!("{}: unknown ggml type {t}", what()))?;
        let offset = c.u64(&what)?;
        if !offset.is_multiple_of(alignment) {
            return Err(format!(
                "{}: data offset {offset} is not a multiple of the alignment {alignment}",
                what()
            ));
        }
        let size = ty
            .tensor_bytes(&ne)
            .map_err(|e| format!("{}: {e}", what()))?;
        if index.insert(name.clone(), tensors.len()).is_some() {
            return Err(format!("tensor `{name}` appears twice"));
        }
        tensors.push(TensorInfo {
            name,
            ne,
            ty,
            offset,
            size,
        });
    }

    let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
    let data_len = (bytes.len() as u64).saturating_sub(data_offset);
    for t in &tensors {
        if t.offset
            .checked_add(t.size)
            .is_none_or(|end| end > data_len)
        {
            return Err(format!(
                "tensor `{}`: data [{}, +{}) lies outside the {data_len}-byte data section (truncated?)",
                t.name, t.offset, t.size
            ));
        }
    }
    Ok(GgufHeader {
        version,
        metadata,
        tensors,
        alignment,
        data_offset,
        index,
        meta_index,
    })
}
