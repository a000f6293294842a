//! The vocabulary as the matcher sees it: each token's text decoded into code points once,
//! so that computing which tokens may come next does not decode 10^5 tokens per step.

/// Bytes still expected of a character split across tokens: its bits so far, how many
/// continuation bytes are missing, and how many bytes the whole character has.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Partial {
    pub value: u32,
    pub missing: u8,
    pub length: u8,
}

/// The surrogate code points, which UTF-8 never encodes.
const SURROGATES: (u32, u32) = (0xd800, 0xdfff);

impl Partial {
    pub fn pending(self) -> bool {
        self.missing > 0
    }

    /// The code points this character can still become: only those that UTF-8 encodes
    /// in exactly `length` bytes (no overlong form, nothing past U+10FFFF), so that the
    /// bytes E0 80 A0 (an overlong space) never pass for a space. `None` when the bytes
    /// so far begin no character at all. A range that reaches into the surrogates is
    /// cut where it can be; one that lies inside them is `None`.
    pub fn range(self) -> Option<(u32, u32)> {
        let shift = 6 * u32::from(self.missing);
        let (mut low, mut high) = (self.value << shift, (self.value << shift) | ((1u32 << shift) - 1));
        low = low.max(shortest_above(self.length));
        high = high.min(0x10ffff);
        if low >= SURROGATES.0 && high <= SURROGATES.1 {
            return None;
        }
        if (SURROGATES.0..=SURROGATES.1).contains(&low) {
            low = SURROGATES.1 + 1;
        }
        if (SURROGATES.0..=SURROGATES.1).contains(&high) {
            high = SURROGATES.0 - 1;
        }
        (low <= high).then_some((low, high))
    }
}

/// The smallest code point UTF-8 writes in `length` bytes.
fn shortest_above(length: u8) -> u32 {
    match length {
        0 | 1 => 0,
        2 => 0x80,
        3 => 0x800,
        _ => 0x10000,
    }
}

/// Decodes `bytes` after `partial` into `out`; returns the character left incomplete at
/// the end, or `None` for bytes that are not UTF-8: a stray continuation byte, a
/// character cut short, an overlong form, a surrogate or a code point past U+10FFFF
/// (the matcher must never let bytes pass for a character they do not encode).
pub(crate) fn decode(bytes: &[u8], mut partial: Partial, out: &mut Vec<u32>) -> Option<Partial> {
    for &byte in bytes {
        if partial.pending() {
            if byte & 0xc0 != 0x80 {
                return None;
            }
            partial.value = (partial.value << 6) | u32::from(byte & 0x3f);
            partial.missing -= 1;
            // Whole or not, the character must still be one UTF-8 encodes this way.
            partial.range()?;
            if !partial.pending() {
                out.push(partial.value);
                partial = Partial::default();
            }
            continue;
        }
        let (value, missing) = match byte {
            0x00..=0x7f => {
                out.push(u32::from(byte));
                continue;
            }
            0xc2..=0xdf => (u32::from(byte & 0x1f), 1),
            0xe0..=0xef => (u32::from(byte & 0x0f), 2),
            0xf0..=0xf4 => (u32::from(byte & 0x07), 3),
            _ => return None,
        };
        partial = Partial {
            value,
            missing,
            length: missing + 1,
        };
    }
    Some(partial)
}

/// How a token takes part in matching.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Text: code points `start..end` of the table, then `trailing` bytes of a character.
    Text { start: u32, end: u32, trailing: Partial },
    /// Text that is not UTF-8 on its own (a continuation byte): decoded on demand, only
    /// after a token that left a character incomplete.
    Fragment,
    /// Renders as nothing (a control token): only a grammar's `<[id]>` admits it.
    Special,
    /// Ends generation: allowed where the grammar is complete.
    EndOfGeneration,
}

/// Every token's text, decoded.
#[derive(Clone, Debug)]
pub struct TokenTable {
    pub(crate) code_points: Vec<u32>,
    pub(crate) kinds: Vec<Kind>,
    pub(crate) bytes: Vec<Vec<u8>>,
}

impl TokenTable {
    /// `tokens[id]` is token `id`'s text as generated output renders it (empty for
    /// control tokens) and whether it ends generation.
    pub fn new(tokens: impl IntoIterator<Item = (Vec<u8>, bool)>) -> TokenTable {
        let mut table = TokenTable {
            code_points: Vec::new(),
            kinds: Vec::new(),
            bytes: Vec::new(),
        };
        for (bytes, end) in tokens {
            let kind = if end {
                Kind::EndOfGeneration
            } else if bytes.is_empty() {
                Kind::Special
            } else {
                let start = table.code_points.len() as u32;
                match decode(&bytes, Partial::default(), &mut table.code_points) {
                    Some(trailing) => Kind::Text {
                        start,
                        end: table.code_points.len() as u32,
                        trailing,
                    },
                    None => {
                        table.code_points.truncate(start as usize);
                        Kind::Fragment
                    }
                }
            };
            table.kinds.push(kind);
            table.bytes.push(bytes);
        }
        table
    }

    /// Tokens in the vocabulary.
    pub fn len(&self) -> usize {
        self.kinds.len()
    }

    /// Whether the vocabulary is empty.
    pub fn is_empty(&self) -> bool {
        self.kinds.is_empty()
    }

    /// Token `id`'s text.
    pub fn bytes(&self, id: u32) -> Option<&[u8]> {
        self.bytes.get(id as usize).map(Vec::as_slice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn characters_split_across_tokens_decode_whole() {
        let euro = "€".as_bytes();
        let mut out = Vec::new();
        let partial = decode(&euro[..1], Partial::default(), &mut out).unwrap();
        assert_eq!((out.len(), partial.missing), (0, 2));
        let (low, high) = partial.range().unwrap();
        assert!(low <= '€' as u32 && '€' as u32 <= high && high < 0x10000);
        let partial = decode(&euro[1..], partial, &mut out).unwrap();
        assert_eq!((out.as_slice(), partial), (&['€' as u32][..], Partial::default()));
        assert_eq!(decode(&[0x80], Partial::default(), &mut out), None);
        assert_eq!(decode(&[0xff], Partial::default(), &mut out), None);
        let table = TokenTable::new([
            (b"a".to_vec(), false),
            (vec![0x80], false),
            (vec![], false),
            (vec![], true),
        ]);
        assert!(matches!(table.kinds[0], Kind::Text { start: 0, end: 1, .. }));
        assert_eq!(
            &table.kinds[1..],
            &[Kind::Fragment, Kind::Special, Kind::EndOfGeneration]
        );
    }
}
