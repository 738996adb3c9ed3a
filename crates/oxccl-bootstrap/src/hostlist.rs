//! Slurm's hostlist syntax, as in `SLURM_STEP_NODELIST` and `SLURM_JOB_NODELIST`.
//!
//! A hostlist is a list of entries separated by commas (or whitespace); an entry is a host
//! name in which bracketed ranges stand for several numbers: `node[01-04,07]` is `node01`,
//! `node02`, `node03`, `node04`, `node07`. A range's numbers are padded with zeros to the width
//! of its first number as written (`n[09-11]` is `n09 n10 n11`, `n[8-10]` is `n8 n9 n10`).
//! Several brackets in one entry give every combination, the leftmost varying slowest
//! (`a[1-2]b[3-4]` is `a1b3 a1b4 a2b3 a2b4`), and entries keep their order and duplicates, as
//! `scontrol show hostnames` prints them. Text may follow the last bracket (`n[1-2]-ib`),
//! which newer Slurm releases accept and 22.05 rejects.
//!
//! ```
//! use oxccl_bootstrap::hostlist;
//!
//! assert_eq!(
//!     hostlist::expand("rack1-n[1-3],login").unwrap(),
//!     ["rack1-n1", "rack1-n2", "rack1-n3", "login"]
//! );
//! assert_eq!(hostlist::first("node[07-10,01]").unwrap(), "node07");
//! assert!(hostlist::expand("node[3-1]").is_err());
//! ```

use std::fmt;

/// The most host names [`expand`] returns (a longer list is refused, not allocated).
pub const MAX_HOSTS: usize = 1 << 20;

/// Why a hostlist cannot be read: what, and at which byte.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostlistError {
    /// The hostlist as given.
    pub list: String,
    /// Byte offset of the problem in `list`.
    pub at: usize,
    /// What is wrong.
    pub reason: String,
}

impl fmt::Display for HostlistError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "bad hostlist {:?}: {} (at byte {})",
            self.list, self.reason, self.at
        )
    }
}

impl std::error::Error for HostlistError {}

/// `lo..=hi`, each number printed with at least `width` digits.
#[derive(Clone, Copy, Debug)]
struct Range {
    lo: u64,
    hi: u64,
    width: usize,
}

impl Range {
    fn len(&self) -> u64 {
        self.hi - self.lo + 1
    }
}

#[derive(Debug)]
enum Piece<'a> {
    Text(&'a str),
    Numbers(Vec<Range>),
}

impl Piece<'_> {
    fn len(&self) -> u64 {
        match self {
            Piece::Text(_) => 1,
            Piece::Numbers(ranges) => ranges.iter().map(Range::len).sum(),
        }
    }

    /// The `i`-th string of this piece, `i < self.len()`.
    fn nth(&self, mut i: u64, out: &mut String) {
        match self {
            Piece::Text(t) => out.push_str(t),
            Piece::Numbers(ranges) => {
                for r in ranges {
                    if i < r.len() {
                        use fmt::Write;
                        let _ = write!(out, "{:0w$}", r.lo + i, w = r.width);
                        return;
                    }
                    i -= r.len();
                }
            }
        }
    }
}

/// One entry: the host names it stands for are the product of its pieces.
#[derive(Debug)]
struct Entry<'a> {
    pieces: Vec<Piece<'a>>,
    /// Number of host names, or `None` past `u64::MAX`.
    count: Option<u64>,
}

impl Entry<'_> {
    /// The `i`-th host name, the leftmost piece varying slowest.
    fn nth(&self, mut i: u64) -> String {
        let mut digits = Vec::with_capacity(self.pieces.len());
        for p in self.pieces.iter().rev() {
            digits.push(i % p.len());
            i /= p.len();
        }
        let mut out = String::new();
        for (p, d) in self.pieces.iter().zip(digits.into_iter().rev()) {
            p.nth(d, &mut out);
        }
        out
    }
}

struct Parser<'a> {
    list: &'a str,
    pos: usize,
}

impl<'a> Parser<'a> {
    fn err(&self, at: usize, reason: impl Into<String>) -> HostlistError {
        HostlistError {
            list: self.list.to_owned(),
            at,
            reason: reason.into(),
        }
    }

    fn peek(&self) -> Option<char> {
        self.list[self.pos..].chars().next()
    }

    fn is_separator(c: char) -> bool {
        c == ',' || c.is_whitespace()
    }

    fn entries(&mut self) -> Result<Vec<Entry<'a>>, HostlistError> {
        let mut entries = Vec::new();
        loop {
            while self.peek().is_some_and(Self::is_separator) {
                self.pos += 1;
            }
            if self.pos == self.list.len() {
                break;
            }
            entries.push(self.entry()?);
        }
        if entries.is_empty() {
            return Err(self.err(0, "no host names in it"));
        }
        Ok(entries)
    }

    fn entry(&mut self) -> Result<Entry<'a>, HostlistError> {
        let mut pieces = Vec::new();
        while let Some(c) = self.peek() {
            match c {
                '[' => pieces.push(Piece::Numbers(self.brackets()?)),
                ']' => return Err(self.err(self.pos, "']' without '['")),
                c if Self::is_separator(c) => break,
                c if c.is_control() => {
                    return Err(self.err(self.pos, format!("control character {c:?}")));
                }
                _ => {
                    let start = self.pos;
                    let end = self.list[start..]
                        .find(|c: char| {
                            matches!(c, '[' | ']') || Self::is_separator(c) || c.is_control()
                        })
                        .map_or(self.list.len(), |n| start + n);
                    pieces.push(Piece::Text(&self.list[start..end]));
                    self.pos = end;
                }
            }
        }
        let count = pieces.iter().try_fold(1u64, |n, p| n.checked_mul(p.len()));
        Ok(Entry { pieces, count })
    }

    /// `[` ranges `]`, the cursor on the `[`.
    fn brackets(&mut self) -> Result<Vec<Range>, HostlistError> {
        let open = self.pos;
        let close = match self.list[open + 1..].find(']') {
            Some(n) => open + 1 + n,
            None => return Err(self.err(open, "'[' without ']'")),
        };
        let inside = &self.list[open + 1..close];
        if let Some(n) = inside.find('[') {
            return Err(self.err(open + 1 + n, "'[' inside brackets"));
        }
        let mut ranges = Vec::new();
        let mut at = open + 1;
        for part in inside.split(',') {
            ranges.push(self.range(part, at)?);
            at += part.len() + 1;
        }
        self.pos = close + 1;
        Ok(ranges)
    }

    /// `N` or `LO-HI` at byte `at`.
    fn range(&self, part: &str, at: usize) -> Result<Range, HostlistError> {
        let number = |s: &str, at: usize| -> Result<u64, HostlistError> {
            if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
                return Err(self.err(
                    at,
                    format!("{part:?} is not a number or a range of numbers (like 1-4 or 07)"),
                ));
            }
            s.parse::<u64>()
                .map_err(|_| self.err(at, format!("{s} is too large")))
        };
        let (lo_s, hi_s) = part.split_once('-').unwrap_or((part, part));
        let lo = number(lo_s, at)?;
        let hi = number(hi_s, at + lo_s.len() + 1)?;
        if hi < lo {
            return Err(self.err(at, format!("range {part} goes down")));
        }
        if hi - lo >= MAX_HOSTS as u64 {
            return Err(self.err(
                at,
                format!("range {part} has more than {MAX_HOSTS} numbers"),
            ));
        }
        Ok(Range {
            lo,
            hi,
            width: lo_s.len(),
        })
    }
}

fn parse(list: &str) -> Result<Vec<Entry<'_>>, HostlistError> {
    Parser { list, pos: 0 }.entries()
}

/// Every host name of `list`, in order (duplicates kept), at most [`MAX_HOSTS`].
pub fn expand(list: &str) -> Result<Vec<String>, HostlistError> {
    let entries = parse(list)?;
    let total = entries
        .iter()
        .try_fold(0u64, |n, e| e.count.and_then(|c| n.checked_add(c)))
        .filter(|&n| n <= MAX_HOSTS as u64)
        .ok_or_else(|| HostlistError {
            list: list.to_owned(),
            at: 0,
            reason: format!("it stands for more than {MAX_HOSTS} host names"),
        })?;
    let mut out = Vec::with_capacity(total as usize);
    for e in &entries {
        out.extend((0..e.count.unwrap_or(0)).map(|i| e.nth(i)));
    }
    Ok(out)
}

/// The first host name of `list` (the whole list is checked, none of it expanded): where
/// Slurm starts task 0, and so the store's host.
pub fn first(list: &str) -> Result<String, HostlistError> {
    let entries = parse(list)?;
    Ok(entries[0].nth(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ok(list: &str) -> Vec<String> {
        expand(list).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn examples_agree_with_scontrol_show_hostnames() {
        // Each expected list is what Slurm 22.05's `scontrol show hostnames` printed.
        let cases: &[(&str, &[&str])] = &[
            ("vm", &["vm"]),
            (
                "node[01-04,07]",
                &["node01", "node02", "node03", "node04", "node07"],
            ),
            ("a[1-2]b[3-4]", &["a1b3", "a1b4", "a2b3", "a2b4"]),
            (
                "rack1-n[1-3],login",
                &["rack1-n1", "rack1-n2", "rack1-n3", "login"],
            ),
            ("n[8-10]", &["n8", "n9", "n10"]),
            ("n[08-10]", &["n08", "n09", "n10"]),
            ("n[008-10]", &["n008", "n009", "n010"]),
            ("n[09-011]", &["n09", "n10", "n11"]),
            ("n[00001-3]", &["n00001", "n00002", "n00003"]),
            ("n[01,3,10-11]", &["n01", "n3", "n10", "n11"]),
            ("n[3,1]", &["n3", "n1"]),
            ("n[2-2,1]", &["n2", "n1"]),
            ("n[1-3],n2", &["n1", "n2", "n3", "n2"]),
            ("n[1-2],m[3-4]", &["n1", "n2", "m3", "m4"]),
            ("n[1-2][3]", &["n13", "n23"]),
            ("n[1-2],,", &["n1", "n2"]),
            ("a,,b", &["a", "b"]),
            ("a b", &["a", "b"]),
            ("[1-2]", &["1", "2"]),
            ("a-b_c.d[1-2]", &["a-b_c.d1", "a-b_c.d2"]),
            ("n[1]", &["n1"]),
        ];
        for (list, want) in cases {
            assert_eq!(ok(list), *want, "{list}");
            assert_eq!(first(list).unwrap(), want[0], "{list}");
        }
    }

    #[test]
    fn suffixes_after_brackets() {
        assert_eq!(ok("n[1-2]-ib"), ["n1-ib", "n2-ib"]);
        assert_eq!(
            ok("x[00-01]y[1,3]z"),
            ["x00y1z", "x00y3z", "x01y1z", "x01y3z"]
        );
    }

    #[test]
    fn errors_say_what_and_where() {
        let cases: &[(&str, usize, &str)] = &[
            ("", 0, "no host names"),
            (" , ", 0, "no host names"),
            ("n[1-2", 1, "'[' without ']'"),
            ("n[1-2]]", 6, "']' without '['"),
            ("n1-2]", 4, "']' without '['"),
            ("n[]", 2, "\"\" is not a number"),
            ("n[a-b]", 2, "\"a-b\" is not a number"),
            ("n[1,,2]", 4, "\"\" is not a number"),
            ("n[-2]", 2, "\"-2\" is not a number"),
            ("n[1-]", 4, "\"1-\" is not a number"),
            ("n[ 1-2]", 2, "\" 1-2\" is not a number"),
            ("n[5-3]", 2, "range 5-3 goes down"),
            ("n[010-8]", 2, "range 010-8 goes down"),
            ("n[1-[2]]", 4, "'[' inside brackets"),
            ("n[99999999999999999999]", 2, "too large"),
            ("n[1-1000000000]", 2, "more than 1048576 numbers"),
            ("ok,n\u{7}x", 4, "control character"),
        ];
        for (list, at, reason) in cases {
            let e = expand(list).unwrap_err();
            assert_eq!(e.at, *at, "{list}: {e}");
            assert!(e.reason.contains(reason), "{list}: {e}");
            assert!(e.to_string().contains(&format!("{list:?}")), "{e}");
            assert_eq!(first(list).unwrap_err(), e, "{list}");
        }
    }

    #[test]
    fn too_many_names_are_refused_but_the_first_is_found() {
        let big = "a[1-1024]b[1-1024]c[1-2]";
        let e = expand(big).unwrap_err();
        assert!(e.reason.contains("more than 1048576 host names"), "{e}");
        assert_eq!(first(big).unwrap(), "a1b1c1");
        let huge = "n[0-999999]".repeat(5);
        assert!(expand(&huge).is_err());
        assert_eq!(first(&huge).unwrap(), "n0n0n0n0n0");
        assert_eq!(ok("n[1-1048576]").len(), MAX_HOSTS);
        assert_eq!(ok("n[1-1048576]").last().unwrap(), "n1048576");
    }

    /// A host name pattern as the property tests generate it: text pieces and bracket pieces,
    /// each range as (first number, how many, zero padding of the first number).
    #[derive(Clone, Debug)]
    enum GenPiece {
        Text(String),
        Numbers(Vec<(u64, u64, usize)>),
    }

    fn gen_piece() -> impl Strategy<Value = GenPiece> {
        prop_oneof![
            "[a-z][a-z0-9._-]{0,4}".prop_map(GenPiece::Text),
            prop::collection::vec((0u64..2000, 1u64..5, 0usize..5), 1..4)
                .prop_map(GenPiece::Numbers),
        ]
    }

    /// Writes the pattern as hostlist text and lists its host names, without the parser:
    /// each piece's strings, then every combination, built up left to right.
    fn render_and_reference(pieces: &[GenPiece]) -> (String, Vec<String>) {
        let mut text = String::new();
        let mut names = vec![String::new()];
        for p in pieces {
            let strings: Vec<String> = match p {
                GenPiece::Text(t) => {
                    text.push_str(t);
                    vec![t.clone()]
                }
                GenPiece::Numbers(ranges) => {
                    let mut inside = Vec::new();
                    let mut strings = Vec::new();
                    for &(lo, n, pad) in ranges {
                        let lo_text = format!("{}{lo}", "0".repeat(pad));
                        let hi = lo + n - 1;
                        inside.push(if n == 1 && pad % 2 == 0 {
                            lo_text.clone()
                        } else {
                            format!("{lo_text}-{hi}")
                        });
                        for k in lo..=hi {
                            let digits = k.to_string();
                            let zeros = lo_text.len().saturating_sub(digits.len());
                            strings.push(format!("{}{digits}", "0".repeat(zeros)));
                        }
                    }
                    text.push('[');
                    text.push_str(&inside.join(","));
                    text.push(']');
                    strings
                }
            };
            names = names
                .iter()
                .flat_map(|prefix| strings.iter().map(move |s| format!("{prefix}{s}")))
                .collect();
        }
        (text, names)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn expands_like_the_naive_reference(
            entries in prop::collection::vec(prop::collection::vec(gen_piece(), 1..4), 1..5),
            sep in prop_oneof![Just(","), Just(" "), Just(",,")],
        ) {
            let mut texts = Vec::new();
            let mut want = Vec::new();
            for e in &entries {
                let (t, names) = render_and_reference(e);
                texts.push(t);
                want.extend(names);
            }
            let list = texts.join(sep);
            prop_assert_eq!(expand(&list).unwrap(), want.clone(), "{}", list);
            prop_assert_eq!(first(&list).unwrap(), want[0].clone());
        }

        #[test]
        fn plain_names_come_back_unchanged(
            names in prop::collection::vec("[a-zA-Z0-9][a-zA-Z0-9._-]{0,12}", 1..20),
        ) {
            prop_assert_eq!(expand(&names.join(",")).unwrap(), names);
        }

        #[test]
        fn any_text_is_read_or_refused_without_panicking(list in "[a-c0-9\\[\\],\\- ]{0,24}") {
            match expand(&list) {
                Ok(names) => {
                    prop_assert!(!names.is_empty());
                    prop_assert_eq!(first(&list).unwrap(), names[0].clone());
                }
                // Too many names to list: the first is still found.
                Err(e) if e.reason.starts_with("it stands for more than") => {
                    prop_assert!(first(&list).is_ok(), "{}", e);
                }
                Err(e) => {
                    prop_assert!(e.at <= list.len(), "{}", e);
                    prop_assert_eq!(first(&list).unwrap_err(), e);
                }
            }
        }
    }
}
