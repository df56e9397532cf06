//! The reasoning parser: splits a thinking model's `<think>…</think>` block off its answer, so chat
//! returns it as `reasoning_content` (streamed as `delta.reasoning_content`) and the Responses API as a
//! `reasoning` item, never mixed into `content`.
//!
//! It works on text, one generated token's text at a time, so a tag the tokenizer splits over several
//! tokens (or that arrives with text around it) is still found: text that may be the start of a tag is
//! held back until the next token settles it. Where generation starts is read from the rendered prompt:
//! a prompt that ends inside an open `<think>` (Qwen3 thinking templates) starts in the reasoning; one
//! that ends with a closed block (Qwen3 with `enable_thinking: false`) starts in the answer; otherwise the
//! model may open the block itself as its first output.

/// The tag that opens a reasoning block.
pub const OPEN: &str = "<think>";
/// The tag that closes a reasoning block.
pub const CLOSE: &str = "</think>";

/// Whether a chat template writes reasoning blocks: what `--reasoning-parser auto` looks for.
pub fn template_thinks(template: &str) -> bool {
    template.contains(OPEN)
}

/// Where the parser stands in the generated text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Nothing but whitespace yet: the model may still open a block.
    Before,
    /// Inside the block.
    Reasoning,
    /// After the block, or in an answer that never opened one.
    Content,
}

/// What one piece of generated text turned into.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Split {
    /// New reasoning text.
    pub reasoning: String,
    /// New answer text.
    pub content: String,
    /// Whether the token belongs to the reasoning block (it counts in the reasoning tokens, and its
    /// logprobs are not the answer's).
    pub in_reasoning: bool,
}

/// The streaming state machine of one choice.
#[derive(Debug, Clone)]
pub struct ReasoningParser {
    phase: Phase,
    /// Text not yet released: possible tag starts, and whitespace that may precede the closing tag.
    held: String,
    /// Whitespace right after a tag is dropped (`<think>\n…\n</think>\n\nanswer`).
    trim_start: bool,
    /// Whether a reasoning block was entered at all (the prompt's or the model's).
    reasoned: bool,
    reasoning_tokens: usize,
}

impl ReasoningParser {
    /// A parser for generation that continues `prompt`, the rendered chat template.
    pub fn for_prompt(prompt: &str) -> Self {
        let tail = prompt.trim_end();
        let phase = if tail.ends_with(OPEN) {
            Phase::Reasoning
        } else if tail.ends_with(CLOSE) {
            Phase::Content
        } else {
            Phase::Before
        };
        ReasoningParser {
            phase,
            held: String::new(),
            trim_start: phase == Phase::Reasoning,
            reasoned: phase == Phase::Reasoning,
            reasoning_tokens: 0,
        }
    }

    /// Whether generation is inside the block (on a fresh parser: the prompt opened it).
    pub fn in_block(&self) -> bool {
        self.phase == Phase::Reasoning
    }

    /// Whether generation is in the answer (on a fresh parser: the prompt closed the block already).
    pub fn in_answer(&self) -> bool {
        self.phase == Phase::Content
    }

    /// Whether the output had a reasoning block (so `reasoning_content` is reported, even empty).
    pub fn reasoned(&self) -> bool {
        self.reasoned
    }

    /// Tokens from the one that completed the opening tag through the one that completed the closing
    /// tag (all of them while the block stays open): `completion_tokens_details.reasoning_tokens`.
    pub fn reasoning_tokens(&self) -> usize {
        self.reasoning_tokens
    }

    /// The text of one generated token (empty while a character is incomplete).
    pub fn push(&mut self, text: &str) -> Split {
        let before = self.phase;
        let mut out = Split::default();
        let mut buf = std::mem::take(&mut self.held);
        buf.push_str(text);
        self.feed(buf, &mut out);
        out.in_reasoning = before == Phase::Reasoning || self.phase == Phase::Reasoning;
        if out.in_reasoning {
            self.reasoning_tokens += 1;
        }
        out
    }

    /// Releases what was held at the end of generation: an unfinished tag is plain text after all.
    pub fn finish(&mut self) -> Split {
        let held = std::mem::take(&mut self.held);
        let mut out = Split::default();
        match self.phase {
            Phase::Reasoning => out.reasoning = held,
            Phase::Before | Phase::Content => out.content = held,
        }
        out
    }

    /// Runs `buf` (held text plus the new text) through the phases it crosses.
    fn feed(&mut self, mut buf: String, out: &mut Split) {
        loop {
            match self.phase {
                Phase::Before => {
                    let lead = buf.trim_start();
                    if let Some(rest) = lead.strip_prefix(OPEN) {
                        buf = rest.to_owned();
                        self.phase = Phase::Reasoning;
                        self.reasoned = true;
                        self.trim_start = true;
                        continue;
                    }
                    if OPEN.starts_with(lead) {
                        // Whitespace or a tag's beginning: the next token decides.
                        self.held = buf;
                    } else {
                        self.phase = Phase::Content;
                        out.content.push_str(&buf);
                    }
                    return;
                }
                Phase::Reasoning => {
                    let text = self.trimmed(&buf);
                    if let Some(at) = text.find(CLOSE) {
                        out.reasoning.push_str(text[..at].trim_end());
                        buf = text[at + CLOSE.len()..].to_owned();
                        self.phase = Phase::Content;
                        self.trim_start = true;
                        continue;
                    }
                    let keep = held_suffix(text);
                    out.reasoning.push_str(&text[..keep]);
                    self.held = text[keep..].to_owned();
                    return;
                }
                Phase::Content => {
                    let text = self.trimmed(&buf);
                    out.content.push_str(text);
                    return;
                }
            }
        }
    }

    /// `text` without leading whitespace while a tag's trailing whitespace is being dropped.
    fn trimmed<'a>(&mut self, text: &'a str) -> &'a str {
        if !self.trim_start {
            return text;
        }
        let t = text.trim_start();
        if !t.is_empty() {
            self.trim_start = false;
        }
        t
    }
}

/// Where the part of reasoning `text` that must wait begins: a suffix that may be the start of the
/// closing tag, with the whitespace before it (dropped if the tag does follow).
fn held_suffix(text: &str) -> usize {
    let mut start = text.len();
    for (i, _) in text.char_indices() {
        if CLOSE.starts_with(&text[i..]) {
            start = i;
            break;
        }
    }
    text[..start].trim_end().len()
}

/// Splits a whole generated text at once: (reasoning, content), reasoning `None` when there was no
/// block. Content is `None` when a block took all of the text.
pub fn split_whole(prompt: &str, text: &str) -> (Option<String>, Option<String>) {
    let mut parser = ReasoningParser::for_prompt(prompt);
    let mut a = parser.push(text);
    let b = parser.finish();
    a.reasoning.push_str(&b.reasoning);
    a.content.push_str(&b.content);
    if !parser.reasoned() {
        return (None, Some(a.content));
    }
    (
        Some(a.reasoning),
        (!a.content.is_empty()).then_some(a.content),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `pieces` one per token and joins the output, checking nothing is released twice.
    fn run(prompt: &str, pieces: &[&str]) -> (String, String, usize, bool) {
        let mut p = ReasoningParser::for_prompt(prompt);
        let (mut r, mut c) = (String::new(), String::new());
        for piece in pieces {
            let s = p.push(piece);
            r.push_str(&s.reasoning);
            c.push_str(&s.content);
        }
        let s = p.finish();
        r.push_str(&s.reasoning);
        c.push_str(&s.content);
        (r, c, p.reasoning_tokens(), p.reasoned())
    }

    /// Every way of cutting `text` into characters, as a tokenizer splitting tags byte by byte would.
    fn chars(text: &str) -> Vec<String> {
        text.chars().map(String::from).collect()
    }

    #[test]
    fn model_opened_block_is_split_off_with_its_whitespace() {
        let (r, c, n, reasoned) = run(
            "<|im_start|>assistant\n",
            &[
                "<think>", "\n", "Let me", " see.", "\n", "</think>", "\n\n", "Paris.",
            ],
        );
        assert_eq!(
            (r.as_str(), c.as_str(), reasoned),
            ("Let me see.", "Paris.", true)
        );
        assert_eq!(n, 6, "<think> through </think>");
    }

    #[test]
    fn tags_split_across_tokens_are_found() {
        let text = "  <think>\nstep one\nstep two\n</think>\n\nThe answer is 4.";
        let pieces = chars(text);
        let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
        let (r, c, n, _) = run("", &pieces);
        assert_eq!(r, "step one\nstep two");
        assert_eq!(c, "The answer is 4.");
        // From the token that completes `<think>` through the one that completes `</think>`.
        let from = text.find(OPEN).unwrap() + OPEN.len() - 1;
        let to = text.find(CLOSE).unwrap() + CLOSE.len();
        assert_eq!(n, text[from..to].chars().count());
        for cut in 0..text.len() {
            if !text.is_char_boundary(cut) {
                continue;
            }
            let (r2, c2, _, _) = run("", &[&text[..cut], &text[cut..]]);
            assert_eq!(
                (r2.as_str(), c2.as_str()),
                (r.as_str(), c.as_str()),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn prompt_opened_block_starts_in_the_reasoning() {
        let prompt = "<|im_start|>assistant\n<think>\n";
        let (r, c, n, reasoned) = run(
            prompt,
            &["Hmm", ",", " ok", "\n</th", "ink>", "\n\n", "Yes"],
        );
        assert_eq!((r.as_str(), c.as_str(), reasoned), ("Hmm, ok", "Yes", true));
        assert_eq!(n, 5);
    }

    #[test]
    fn closed_block_in_the_prompt_means_plain_answer() {
        let prompt = "<|im_start|>assistant\n<think>\n\n</think>\n\n";
        let (r, c, n, reasoned) = run(prompt, &["<think>", "x", "</think>", "y"]);
        assert_eq!(
            (r.as_str(), c.as_str(), n, reasoned),
            ("", "<think>x</think>y", 0, false)
        );
    }

    #[test]
    fn output_without_tags_is_all_content_unchanged() {
        for pieces in [
            &["Hello", " world"][..],
            &["  ", "\n", "<", "b>", "hi"][..],
            &["  "][..],
        ] {
            let (r, c, n, reasoned) = run("<|im_start|>assistant\n", pieces);
            assert_eq!((r.as_str(), n, reasoned), ("", 0, false));
            assert_eq!(c, pieces.concat());
        }
        // A partial open tag at the very end is text.
        let (_, c, _, reasoned) = run("", &["<thi"]);
        assert_eq!((c.as_str(), reasoned), ("<thi", false));
    }

    #[test]
    fn unterminated_reasoning_at_max_tokens_is_all_reasoning() {
        let (r, c, n, reasoned) = run("", &["<think>", "\n", "still thinking", " </th"]);
        assert_eq!(
            (r.as_str(), c.as_str(), reasoned),
            ("still thinking </th", "", true)
        );
        assert_eq!(n, 4);
        assert_eq!(
            split_whole("", "<think>\nstill thinking"),
            (Some("still thinking".to_owned()), None)
        );
    }

    #[test]
    fn text_after_the_block_keeps_later_tags_and_whitespace() {
        let (r, c, _, _) = run(
            "",
            &[
                "<think>a</think>",
                "\n",
                "x\n\n",
                "<tool_call>",
                "\n</think>",
            ],
        );
        assert_eq!(r, "a");
        assert_eq!(c, "x\n\n<tool_call>\n</think>");
    }

    #[test]
    fn whitespace_inside_the_reasoning_is_released_once_text_follows() {
        let mut p = ReasoningParser::for_prompt("<think>");
        assert_eq!(p.push("a").reasoning, "a");
        assert_eq!(p.push("\n\n").reasoning, "", "might precede </think>");
        assert_eq!(p.push("b").reasoning, "\n\nb");
        assert_eq!(p.push(" <").reasoning, "");
        assert_eq!(p.push("x").reasoning, " <x");
    }

    #[test]
    fn split_whole_matches_streaming() {
        assert_eq!(split_whole("", "plain"), (None, Some("plain".to_owned())));
        assert_eq!(
            split_whole("", "<think>r</think>\n\nc"),
            (Some("r".to_owned()), Some("c".to_owned()))
        );
        assert_eq!(
            split_whole("<think>\n", "</think>"),
            (Some(String::new()), None)
        );
    }

    #[test]
    fn templates_that_think_are_recognized() {
        assert!(template_thinks("{{ '<think>\\n\\n</think>\\n\\n' }}"));
        assert!(!template_thinks("{{ '<|im_start|>assistant\\n' }}"));
    }
}
