//! The YAML parser of the settings: every unknown key and bad value at once, each by its full path, line
//! and column, with the closest known key for a typo.

use anyhow::{bail, Result};
use serde::de::DeserializeOwned;
use serde::{Deserializer, Serialize};
use serde_json::Value;

/// Most problems one parse reports; past them the file is likely not a tandem config at all.
const MAX_PROBLEMS: usize = 20;

/// Parses a YAML settings document, reporting every problem at once rather than the first: each unknown
/// key by its full path with the closest known key at that place (`server.prot: unknown key, did you
/// mean `port`?`), each bad value by its full path; each with its line and column in `text` (`line 2,
/// column 3: engine.blok_size: ...`). Syntax errors keep serde_yaml's line and column.
///
/// serde stops at the first error, so the document is parsed as a tree, deserialized with
/// `serde_path_to_error` (which knows the path), and each offending key is taken out of the tree before
/// the next try; the known keys come from serde's own `expected one of` list, so no second schema exists.
pub fn parse_settings<T: DeserializeOwned + Serialize + Default>(text: &str) -> Result<T> {
    // Every key of every section at its default (unset fields are written as null): the known keys
    // where serde's message lists none (a section with a flattened part, like `server:`).
    let schema = serde_json::to_value(T::default()).unwrap_or(Value::Null);
    let mut doc: Value = serde_yaml::from_str(text)?;
    if doc.is_null() {
        // An empty file, like `{}`: every setting at its default.
        doc = Value::Object(serde_json::Map::new());
    }
    let mut problems = Vec::new();
    loop {
        let err = match serde_path_to_error::deserialize::<_, T>(&doc) {
            Ok(settings) if problems.is_empty() => return Ok(settings),
            Ok(_) => break,
            Err(err) => err,
        };
        let path: Vec<String> = err
            .path()
            .iter()
            .filter_map(|segment| match segment {
                serde_path_to_error::Segment::Map { key } => Some(key.clone()),
                serde_path_to_error::Segment::Seq { index } => Some(index.to_string()),
                _ => None,
            })
            .collect();
        let message = err.inner().to_string();
        let removed = match unknown_field(&message) {
            Some((key, expected)) => {
                // serde_path_to_error's path ends at the unknown key itself.
                let mut full = path.clone();
                if full.last() != Some(&key) {
                    full.push(key.clone());
                }
                let expected = if expected.is_empty() {
                    keys_at(&schema, &path)
                } else {
                    expected
                };
                let suggestion = closest(&key, &expected)
                    .map(|k| format!(", did you mean `{k}`?"))
                    .unwrap_or_default();
                let at = located(text, &full, Node::Key);
                problems.push(format!("{at}{}: unknown key{suggestion}", full.join(".")));
                remove_key(&mut doc, &full)
            }
            None => {
                let at = if path.is_empty() {
                    "(top level)".to_owned()
                } else {
                    format!("{}{}", located(text, &path, Node::Value), path.join("."))
                };
                problems.push(format!("{at}: {message}"));
                remove_key(&mut doc, &path)
            }
        };
        // An error the tree cannot be freed of (inside a flattened section, or at the top) ends the search.
        if !removed || problems.len() >= MAX_PROBLEMS {
            break;
        }
    }
    let count = problems.len();
    bail!(
        "{count} problem{} in the settings:\n  {}",
        if count == 1 { "" } else { "s" },
        problems.join("\n  ")
    )
}

/// A value parsing accepted and a check refused, by the full path of its key, so that a config file's
/// error can say where the key stands (`Settings::load`).
#[derive(Debug)]
pub struct BadValue {
    /// The full key path, e.g. `server.max_connections`.
    pub key: String,
    /// What is wrong, continuing the sentence after the key.
    pub message: String,
}

impl std::fmt::Display for BadValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.key, self.message)
    }
}

impl std::error::Error for BadValue {}

/// A [`BadValue`] error.
pub(super) fn bad_value(key: impl Into<String>, message: impl Into<String>) -> anyhow::Error {
    BadValue {
        key: key.into(),
        message: message.into(),
    }
    .into()
}

/// `e` with the line and column of its key in `text` in front, when it is a [`BadValue`] found there.
pub(super) fn with_line(text: &str, e: anyhow::Error) -> anyhow::Error {
    let Some(bad) = e.downcast_ref::<BadValue>() else {
        return e;
    };
    let path: Vec<String> = bad.key.split('.').map(str::to_owned).collect();
    match located(text, &path, Node::Value) {
        at if at.is_empty() => e,
        at => anyhow::anyhow!("{at}{bad}"),
    }
}

/// Which node of a key path [`locate`] finds: the last key itself, or the value it holds.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Node {
    Key,
    Value,
}

/// `line L, column C: ` for the node at `path` in the YAML `text` (1-based), or nothing when it is not
/// found there (a key that only a flattened section or an alias produced).
fn located(text: &str, path: &[String], node: Node) -> String {
    locate(text, path, node)
        .map(|(line, column)| format!("line {line}, column {column}: "))
        .unwrap_or_default()
}

/// The error message [`Locate`] stops the walk with when it reaches its node.
const FOUND: &str = "tandem-config-node-found";

/// The line and column of the node at `path` in the YAML `text`. serde_yaml's trees keep no positions, but
/// an error raised while one of its nodes is visited is stamped with that node's, so a walk down the path
/// that fails on arrival reads the position off the error.
pub(super) fn locate(text: &str, path: &[String], node: Node) -> Option<(usize, usize)> {
    use serde::de::DeserializeSeed;
    let err = Locate { path, node }
        .deserialize(serde_yaml::Deserializer::from_str(text))
        .err()?;
    if !err.to_string().contains(FOUND) {
        return None;
    }
    let at = err.location()?;
    Some((at.line(), at.column()))
}

/// One step of [`locate`]'s walk: the rest of the path below the node being visited.
struct Locate<'a> {
    path: &'a [String],
    node: Node,
}

impl Locate<'_> {
    /// What visiting a node gives: the stop when the path ends here, else nothing (not found below a scalar).
    fn arrive<E: serde::de::Error>(&self) -> std::result::Result<(), E> {
        if self.path.is_empty() {
            Err(E::custom(FOUND))
        } else {
            Ok(())
        }
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for Locate<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Locate<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any YAML node")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(
        self,
        mut map: A,
    ) -> std::result::Result<(), A::Error> {
        self.arrive()?;
        let (key, rest) = self.path.split_first().expect("arrive checked the path");
        let stop_at_key = rest.is_empty() && self.node == Node::Key;
        while let Some(hit) = map.next_key_seed(KeyIs {
            key,
            stop: stop_at_key,
        })? {
            if hit {
                return map.next_value_seed(Locate {
                    path: rest,
                    node: self.node,
                });
            }
            map.next_value::<serde::de::IgnoredAny>()?;
        }
        Ok(())
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(
        self,
        mut seq: A,
    ) -> std::result::Result<(), A::Error> {
        self.arrive()?;
        let (index, rest) = self.path.split_first().expect("arrive checked the path");
        let Ok(index) = index.parse::<usize>() else {
            return Ok(());
        };
        for _ in 0..index {
            if seq.next_element::<serde::de::IgnoredAny>()?.is_none() {
                return Ok(());
            }
        }
        seq.next_element_seed(Locate {
            path: rest,
            node: self.node,
        })?;
        Ok(())
    }

    fn visit_bool<E: serde::de::Error>(self, _: bool) -> std::result::Result<(), E> {
        self.arrive()
    }

    fn visit_i64<E: serde::de::Error>(self, _: i64) -> std::result::Result<(), E> {
        self.arrive()
    }

    fn visit_u64<E: serde::de::Error>(self, _: u64) -> std::result::Result<(), E> {
        self.arrive()
    }

    fn visit_f64<E: serde::de::Error>(self, _: f64) -> std::result::Result<(), E> {
        self.arrive()
    }

    fn visit_str<E: serde::de::Error>(self, _: &str) -> std::result::Result<(), E> {
        self.arrive()
    }

    fn visit_unit<E: serde::de::Error>(self) -> std::result::Result<(), E> {
        self.arrive()
    }

    fn visit_none<E: serde::de::Error>(self) -> std::result::Result<(), E> {
        self.arrive()
    }
}

/// A mapping key compared with one key of [`locate`]'s path: whether it is that key, or the stop when the
/// walk ends at this key.
struct KeyIs<'a> {
    key: &'a str,
    stop: bool,
}

impl KeyIs<'_> {
    /// Compares a key's text with the wanted one.
    fn check<E: serde::de::Error>(&self, text: &str) -> std::result::Result<bool, E> {
        match (text == self.key, self.stop) {
            (true, true) => Err(E::custom(FOUND)),
            (hit, _) => Ok(hit),
        }
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for KeyIs<'_> {
    type Value = bool;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<bool, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for KeyIs<'_> {
    type Value = bool;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a mapping key")
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<bool, E> {
        self.check(v)
    }

    fn visit_bool<E: serde::de::Error>(self, v: bool) -> std::result::Result<bool, E> {
        self.check(&v.to_string())
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> std::result::Result<bool, E> {
        self.check(&v.to_string())
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> std::result::Result<bool, E> {
        self.check(&v.to_string())
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> std::result::Result<bool, E> {
        self.check(&v.to_string())
    }

    fn visit_unit<E: serde::de::Error>(self) -> std::result::Result<bool, E> {
        self.check("null")
    }
}

/// The key and the allowed keys of serde's unknown-field error (`unknown field `x`, expected one of
/// `a`, `b``, `expected `a``, or `there are no fields`).
fn unknown_field(message: &str) -> Option<(String, Vec<String>)> {
    let rest = message.strip_prefix("unknown field `")?;
    let (key, rest) = rest.split_once('`')?;
    let expected = rest
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect();
    Some((key.to_owned(), expected))
}

/// The known key `key` was most likely meant to be, when one is close enough to suggest.
fn closest<'a>(key: &str, known: &'a [String]) -> Option<&'a str> {
    known
        .iter()
        .map(|k| (strsim::jaro_winkler(key, k), k))
        .filter(|(score, _)| *score >= 0.8)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, k)| k.as_str())
}

/// The keys of the object at `path` in `schema` (none when there is no object there).
fn keys_at(schema: &Value, path: &[String]) -> Vec<String> {
    path.iter()
        .try_fold(schema, |at, key| at.get(key))
        .and_then(Value::as_object)
        .map(|map| map.keys().cloned().collect())
        .unwrap_or_default()
}

/// Removes the value at `path` from `doc`; false when there is no such key (or the path is empty).
fn remove_key(doc: &mut Value, path: &[String]) -> bool {
    let Some((last, parents)) = path.split_last() else {
        return false;
    };
    let mut at = doc;
    for key in parents {
        at = match at {
            Value::Object(map) => match map.get_mut(key) {
                Some(next) => next,
                None => return false,
            },
            Value::Array(items) => match key.parse::<usize>().ok().and_then(|i| items.get_mut(i)) {
                Some(next) => next,
                None => return false,
            },
            _ => return false,
        };
    }
    match at {
        Value::Object(map) => map.remove(last).is_some(),
        _ => false,
    }
}
