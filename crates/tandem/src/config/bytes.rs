//! [`ByteSize`]: a byte count written with or without a unit, in YAML and on the command line.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A byte count written either as an integer or with a unit ("1GiB", "512MiB", "2GB", "4096").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ByteSize(pub usize);

impl std::str::FromStr for ByteSize {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let split = s
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(s.len());
        let (number, unit) = s.split_at(split);
        let value: f64 = number
            .parse()
            .map_err(|_| format!("`{s}` is not a size like 1GiB, 512MiB or 4096"))?;
        let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kb" => 1_000,
            "kib" | "ki" => 1 << 10,
            "m" | "mb" => 1_000_000,
            "mib" | "mi" => 1 << 20,
            "g" | "gb" => 1_000_000_000,
            "gib" | "gi" => 1 << 30,
            "t" | "tb" => 1_000_000_000_000,
            "tib" | "ti" => 1 << 40,
            other => return Err(format!("unknown size unit `{other}` in `{s}`")),
        };
        let bytes = value * scale as f64;
        if !bytes.is_finite() || bytes < 1.0 || bytes > usize::MAX as f64 {
            return Err(format!("size `{s}` is out of range"));
        }
        Ok(ByteSize(bytes as usize))
    }
}

/// The largest binary unit that divides the count exactly ("1GiB", "1536MiB", "4096"), so it parses back
/// to the same count: clap shows defaults this way.
impl std::fmt::Display for ByteSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let units = [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")];
        match units
            .iter()
            .find(|(shift, _)| self.0 > 0 && self.0.is_multiple_of(1usize << shift))
        {
            Some((shift, unit)) => write!(f, "{}{unit}", self.0 >> shift),
            None => write!(f, "{}", self.0),
        }
    }
}

/// Written as the byte count, which reads back exactly.
impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_u64(self.0 as u64)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Int(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Int(n) => Ok(ByteSize(n as usize)),
            Raw::Text(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}
