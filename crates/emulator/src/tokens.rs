//! The emulator's tokenizer and prefix cache.
//!
//! Tokens are whitespace-separated words cut into chunks of at most four
//! characters: deterministic, cheap, and close enough to a BPE tokenizer's
//! count (about four characters a token on English text) that token rates
//! and usage behave like a real server's. It is not any model's tokenizer.

use std::hash::Hasher;
use std::num::NonZeroUsize;

use lru::LruCache;

/// Characters per token at most.
const CHUNK: usize = 4;

/// Tokens per cache block: a prompt's prefix is cached and matched in whole
/// blocks, as vLLM's automatic prefix cache does with its KV blocks.
pub const BLOCK_TOKENS: usize = 16;

/// Splits `text` into tokens (see the module doc).
pub fn tokenize(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    for word in text.split_whitespace() {
        let mut start = 0;
        let mut count = 0;
        for (i, _) in word.char_indices() {
            if count == CHUNK {
                out.push(&word[start..i]);
                start = i;
                count = 0;
            }
            count += 1;
        }
        out.push(&word[start..]);
    }
    out
}

/// Counts the tokens of `text` without keeping them.
pub fn count(text: &str) -> usize {
    tokenize(text).len()
}

/// An LRU of prompt-prefix blocks. Each full block of [`BLOCK_TOKENS`]
/// tokens is keyed by a hash chained over every token before it, so a block
/// only matches when the whole prefix up to it matches.
pub struct PrefixCache {
    blocks: Option<LruCache<u64, ()>>,
}

impl PrefixCache {
    /// A cache holding about `tokens` prompt tokens; 0 disables it.
    pub fn new(tokens: u64) -> Self {
        let blocks = usize::try_from(tokens / BLOCK_TOKENS as u64)
            .ok()
            .and_then(NonZeroUsize::new)
            .map(LruCache::new);
        Self { blocks }
    }

    /// Looks `prompt` up, returns how many of its leading tokens were
    /// cached, and caches all of its full blocks (most recently used).
    pub fn lookup_and_insert(&mut self, prompt: &[&str]) -> usize {
        let Some(blocks) = self.blocks.as_mut() else {
            return 0;
        };
        let mut hasher = fnv::FnvHasher::default();
        let mut cached = 0;
        let mut matching = true;
        for block in prompt.chunks_exact(BLOCK_TOKENS) {
            for token in block {
                hasher.write(token.as_bytes());
                hasher.write_u8(0xff);
            }
            let key = hasher.finish();
            if matching && blocks.get(&key).is_some() {
                cached += BLOCK_TOKENS;
            } else {
                matching = false;
                blocks.put(key, ());
            }
        }
        cached
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_are_cut_in_four_character_chunks() {
        assert_eq!(
            tokenize("hello world a"),
            vec!["hell", "o", "worl", "d", "a"]
        );
        assert_eq!(count("  "), 0);
        assert_eq!(tokenize("été"), vec!["été"]);
    }

    #[test]
    fn a_repeated_prefix_hits_whole_blocks() {
        let mut cache = PrefixCache::new(1024);
        let shared = "word ".repeat(40);
        let a = format!("{shared} first question here");
        let b = format!("{shared} second question");
        assert_eq!(cache.lookup_and_insert(&tokenize(&a)), 0);
        // 40 shared tokens: two whole blocks of 16.
        assert_eq!(cache.lookup_and_insert(&tokenize(&b)), 32);
        assert_eq!(PrefixCache::new(0).lookup_and_insert(&tokenize(&a)), 0);
    }
}
