//! Byte sizes as users write them (`--ram-budget 8GiB`) and as we print them.
//!
//! Binary units are the default because memory is sold and limited in them:
//! `K`, `M`, `G`, `T` and `KiB` … `TiB` are powers of 1024; `KB` … `TB` are
//! powers of 1000 (as drive makers use them). Fractions are allowed
//! (`1.5G`), and a plain number is bytes. Anything else is an error that
//! quotes the input, never a silent guess.

use std::fmt;
use std::str::FromStr;

/// A number of bytes, parsed from or printed as human text.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default, serde::Serialize)]
#[serde(transparent)]
pub struct ByteSize(pub u64);

/// Why a size did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid size `{input}`: {reason} (examples: 512MiB, 8GiB, 1.5G, 2000000000, 64GB; \
     K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB powers of 1000)"
)]
pub struct SizeError {
    /// The text given.
    pub input: String,
    /// What is wrong with it.
    pub reason: String,
}

impl ByteSize {
    /// The size in bytes.
    pub fn bytes(self) -> u64 {
        self.0
    }
}

fn unit_multiplier(unit: &str) -> Option<u64> {
    const KI: u64 = 1 << 10;
    let lower = unit.to_ascii_lowercase();
    Some(match lower.as_str() {
        "" | "b" => 1,
        "k" | "kib" => KI,
        "m" | "mib" => KI * KI,
        "g" | "gib" => KI * KI * KI,
        "t" | "tib" => KI * KI * KI * KI,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return None,
    })
}

impl FromStr for ByteSize {
    type Err = SizeError;

    fn from_str(text: &str) -> Result<Self, SizeError> {
        let fail = |reason: &str| SizeError {
            input: text.to_string(),
            reason: reason.to_string(),
        };
        let trimmed = text.trim();
        let split = trimmed
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(trimmed.len());
        let (number, unit) = trimmed.split_at(split);
        let unit = unit.trim();
        if number.is_empty() {
            return Err(fail("no number"));
        }
        let multiplier = unit_multiplier(unit).ok_or_else(|| fail("unknown unit"))?;
        if let Ok(whole) = number.parse::<u64>() {
            return whole
                .checked_mul(multiplier)
                .map(ByteSize)
                .ok_or_else(|| fail("too large"));
        }
        let value: f64 = number.parse().map_err(|_| fail("not a number"))?;
        let bytes = value * multiplier as f64;
        if !bytes.is_finite() || bytes >= u64::MAX as f64 {
            return Err(fail("too large"));
        }
        Ok(ByteSize(bytes.round() as u64))
    }
}

impl fmt::Display for ByteSize {
    /// Binary units with up to two decimals (`1.50 GiB`), plain bytes below
    /// one KiB.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
        let mut value = self.0 as f64;
        let mut unit = 0;
        while value >= 1024.0 && unit + 1 < UNITS.len() {
            value /= 1024.0;
            unit += 1;
        }
        if unit == 0 {
            write!(f, "{} B", self.0)
        } else {
            write!(f, "{value:.2} {}", UNITS[unit])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> u64 {
        text.parse::<ByteSize>().expect(text).0
    }

    #[test]
    fn accepts_the_documented_forms() {
        assert_eq!(parse("512MiB"), 512 << 20);
        assert_eq!(parse("8GiB"), 8 << 30);
        assert_eq!(parse("8G"), 8 << 30);
        assert_eq!(parse("1.5G"), 3 << 29);
        assert_eq!(parse("1234"), 1234);
        assert_eq!(parse("64GB"), 64_000_000_000);
        assert_eq!(parse(" 2 mib "), 2 << 20);
        assert_eq!(parse("0"), 0);
        assert_eq!(parse("100b"), 100);
    }

    #[test]
    fn rejects_garbage_with_the_input_quoted() {
        for bad in ["", "GiB", "12XB", "1.2.3G", "-5", "99999999999999999999T"] {
            let err = bad.parse::<ByteSize>().expect_err(bad);
            assert!(err.to_string().contains(&format!("`{bad}`")), "{err}");
        }
    }

    #[test]
    fn prints_binary_units() {
        assert_eq!(ByteSize(1000).to_string(), "1000 B");
        assert_eq!(ByteSize(3 << 29).to_string(), "1.50 GiB");
        assert_eq!(ByteSize(512 << 20).to_string(), "512.00 MiB");
    }
}
