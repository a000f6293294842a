//! Turning generated tokens into text a client can be sent: whole UTF-8 characters only,
//! and never a stop string, nor the part of one that may still complete, even when it
//! spans several tokens.

/// What one token adds to the output.
#[derive(Debug, PartialEq, Eq)]
pub enum Piece {
    /// Text that can be sent now (may be empty: held back, or half a character).
    Text(String),
    /// A stop string was completed: send this text (what came before the stop), then stop.
    Stop(String),
}

/// Accumulates token bytes, releasing text that can no longer turn into a stop string.
#[derive(Debug, Default)]
pub struct TextStream {
    stops: Vec<String>,
    /// Bytes of an incomplete UTF-8 character.
    partial: Vec<u8>,
    /// Decoded text not yet released.
    held: String,
    /// The stop string that ended the text, once one has.
    matched: Option<usize>,
}

impl TextStream {
    /// A stream that stops at any of `stops` (empty strings are ignored).
    pub fn new(stops: &[String]) -> TextStream {
        TextStream {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            ..TextStream::default()
        }
    }

    /// Adds one token's bytes.
    pub fn push(&mut self, bytes: &[u8]) -> Piece {
        self.partial.extend_from_slice(bytes);
        self.decode();
        if let Some((at, which)) = self.first_stop() {
            let text = self.held[..at].to_string();
            self.held.clear();
            self.matched = Some(which);
            return Piece::Stop(text);
        }
        let keep = self.stop_prefix_len();
        let release = self.held.len() - keep;
        let text = self.held[..release].to_string();
        self.held.drain(..release);
        Piece::Text(text)
    }

    /// Everything still held, at the end of generation (an incomplete character becomes
    /// U+FFFD).
    pub fn finish(&mut self) -> String {
        let mut text = std::mem::take(&mut self.held);
        text.push_str(&String::from_utf8_lossy(&std::mem::take(&mut self.partial)));
        text
    }

    /// Moves the complete characters of `partial` into `held`; invalid bytes become
    /// U+FFFD, an incomplete character at the end waits for the next token.
    fn decode(&mut self) {
        loop {
            match std::str::from_utf8(&self.partial) {
                Ok(text) => {
                    self.held.push_str(text);
                    self.partial.clear();
                    return;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    self.held
                        .push_str(std::str::from_utf8(&self.partial[..valid]).unwrap_or_default());
                    match e.error_len() {
                        Some(bad) => {
                            self.held.push('\u{FFFD}');
                            self.partial.drain(..valid + bad);
                        }
                        None => {
                            self.partial.drain(..valid);
                            return;
                        }
                    }
                }
            }
        }
    }

    /// Byte offset in `held` of the earliest complete stop string.
    /// Where the first stop string in the held text begins, and which one it is.
    fn first_stop(&self) -> Option<(usize, usize)> {
        let found = self.stops.iter().enumerate();
        found
            .filter_map(|(which, stop)| Some((self.held.find(stop.as_str())?, which)))
            .min()
    }

    /// The stop string that ended the text, if one did.
    pub fn matched(&self) -> Option<&str> {
        self.matched.map(|which| self.stops[which].as_str())
    }

    /// Length of the longest suffix of `held` that some stop string starts with.
    fn stop_prefix_len(&self) -> usize {
        let mut longest = 0;
        for stop in &self.stops {
            for (start, _) in self.held.char_indices() {
                let suffix = &self.held[start..];
                if suffix.len() <= longest {
                    break;
                }
                if stop.starts_with(suffix) {
                    longest = suffix.len();
                    break;
                }
            }
        }
        longest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (Vec<Piece>, String) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut stream = TextStream::new(&stops);
        let out = pieces.iter().map(|p| stream.push(p.as_bytes())).collect();
        (out, stream.finish())
    }

    fn text(s: &str) -> Piece {
        Piece::Text(s.into())
    }

    /// The stop string that ended the text is named (the earliest in the text, whatever
    /// its place in the list), for Anthropic's `stop_sequence`.
    #[test]
    fn the_stop_string_that_matched_is_named() {
        let stops = ["END".to_string(), "\n\n".to_string()];
        let mut stream = TextStream::new(&stops);
        assert_eq!(stream.push(b"one\n"), text("one"));
        assert_eq!(stream.matched(), None);
        assert_eq!(stream.push(b"\nEND"), Piece::Stop(String::new()));
        assert_eq!(stream.matched(), Some("\n\n"));
    }

    #[test]
    fn without_stops_text_passes_straight_through() {
        let (out, rest) = run(&[], &["Hello", ",", " world"]);
        assert_eq!(out, [text("Hello"), text(","), text(" world")]);
        assert_eq!(rest, "");
    }

    #[test]
    fn a_stop_spanning_tokens_is_never_sent() {
        let (out, _) = run(&["END"], &["abc E", "N", "D tail"]);
        assert_eq!(out, [text("abc "), text(""), Piece::Stop("".into())]);
        let (out, _) = run(&["\n\n"], &["line\n", "\nmore"]);
        assert_eq!(out, [text("line"), Piece::Stop("".into())]);
        let (out, _) = run(&["stop"], &["go stop now"]);
        assert_eq!(out, [Piece::Stop("go ".into())]);
    }

    #[test]
    fn a_false_start_is_released() {
        let (out, rest) = run(&["END"], &["E", "N", "x", "END"]);
        assert_eq!(out, [text(""), text(""), text("ENx"), Piece::Stop("".into())]);
        assert_eq!(rest, "");
        let (out, rest) = run(&["END"], &["abc E"]);
        assert_eq!(out, [text("abc ")]);
        assert_eq!(rest, "E", "held text comes out at the end");
    }

    #[test]
    fn the_earliest_of_several_stops_wins() {
        let (out, _) = run(&["b", "ab"], &["xxab"]);
        assert_eq!(out, [Piece::Stop("xx".into())]);
    }

    #[test]
    fn characters_split_across_tokens_are_sent_whole() {
        let euro = "€".as_bytes(); // 3 bytes
        let mut stream = TextStream::new(&[]);
        assert_eq!(stream.push(&euro[..1]), text(""));
        assert_eq!(stream.push(&euro[1..]), text("€"));
        assert_eq!(stream.push(&[0xff, b'a']), text("\u{FFFD}a"));
        assert_eq!(stream.push(&euro[..2]), text(""));
        assert_eq!(stream.finish(), "\u{FFFD}");
    }
}
