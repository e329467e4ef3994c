//! The Lua scripts that change a record in place, one `.lua` file each beside this one.
//!
//! Every script takes one key, `KEYS[1]`, the record, and works on the codec's layout
//! ([`codec`]): the state byte is `string.byte(v, 2)`, the owner token
//! `string.sub(v, 43, 58)`, a pending record is 66 bytes long and one byte more once a waiter
//! flagged it (`watch.lua`), and everything after byte 42 is the state's own part, which
//! `complete` and `mark_unknown` splice in. The owner-only scripts (complete, mark_unknown,
//! renew, release) all start with the same check of state byte and owner token, and the ones
//! that end a pending state `PUBLISH` the key (channel and message are the last two ARGV) only
//! when a waiter flagged the record: most keys are never waited on, and then nothing is sent.
//!
//! The files are kept byte for byte as the scripts Redis already knows (their SHA-1 is how
//! `EVALSHA` names them), so a gateway of this version and one of the last share them; the tests
//! below pin both the hashes and the offsets to the codec's.

use redis::Script;

#[cfg(test)]
use super::super::codec;

/// The scripts, hashed once at startup.
pub struct Scripts {
    /// ARGV: owner, completed tail, ttl ms, channel, message.
    pub complete: Script,
    /// ARGV: owner, unknown tail, channel, message.
    pub mark_unknown: Script,
    /// ARGV: owner, new lease (8 bytes). Keeps a waiter's flag.
    pub renew: Script,
    /// ARGV: owner, channel, message.
    pub release: Script,
    /// ARGV: channel, message. Deletes whoever owns the record (operators).
    pub delete: Script,
    /// ARGV: expected record, new record, ttl ms. A waiter's flag on the expected record is not
    /// a change: it is kept on the new one. Answers 1 also when the new record is there already
    /// (its random token makes it this call's own): the cluster client sent it again after
    /// losing the first answer, and the first one landed.
    pub take_over: Script,
    /// No ARGV. The record as it was; if it is pending, also flags it as waited on.
    pub watch: Script,
}

impl Scripts {
    pub fn new() -> Self {
        Scripts {
            complete: Script::new(include_str!("complete.lua")),
            mark_unknown: Script::new(include_str!("mark_unknown.lua")),
            renew: Script::new(include_str!("renew.lua")),
            release: Script::new(include_str!("release.lua")),
            delete: Script::new(include_str!("delete.lua")),
            take_over: Script::new(include_str!("take_over.lua")),
            watch: Script::new(include_str!("watch.lua")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Redis that ran the previous version already holds these scripts under these names.
    #[test]
    fn the_scripts_are_the_ones_redis_knows() {
        let s = Scripts::new();
        for (script, sha) in [
            (&s.complete, "88d1cff3bca399ed5d58ffdd9d1bc96568e384d7"),
            (&s.mark_unknown, "a22fec8ee538ffdf6e1374aa44aa81205d522e0d"),
            (&s.renew, "7db22f99983ed7861f08882349460e946ffe0021"),
            (&s.release, "1b8eaf848d520b3de094f6d17a6fec15362cd0d7"),
            (&s.delete, "28535c4c7c0f2a04c6eee7c0210807833749da45"),
            (&s.take_over, "6db0d8c33d086c5cf77b8770f6af7de209848fa1"),
            (&s.watch, "0c051a818d3a87f14b5baeb2f48c416be004ad93"),
        ] {
            assert_eq!(script.get_hash(), sha);
        }
    }

    /// The offsets written in the scripts are the codec's (Lua counts from 1).
    #[test]
    fn the_scripts_use_the_codec_layout() {
        let owner_at = codec::HEADER_LEN + 1;
        let owner_check = format!(
            "string.byte(v, 2) ~= {} or string.sub(v, {owner_at}, {}) ~= ARGV[1]",
            codec::STATE_PENDING,
            codec::HEADER_LEN + 16
        );
        let flagged = format!("string.byte(v, {}) == 1", codec::PENDING_LEN + 1);
        for owned in [
            include_str!("complete.lua"),
            include_str!("mark_unknown.lua"),
            include_str!("renew.lua"),
            include_str!("release.lua"),
        ] {
            assert!(owned.contains(&owner_check), "{owned}");
        }
        for announcing in [
            include_str!("complete.lua"),
            include_str!("mark_unknown.lua"),
            include_str!("release.lua"),
            include_str!("delete.lua"),
        ] {
            assert!(announcing.contains(&flagged), "{announcing}");
        }
        let splice = format!("string.sub(v, 3, {})", codec::HEADER_LEN);
        assert!(include_str!("complete.lua")
            .contains(&format!("'\\{}' .. {splice}", codec::STATE_COMPLETED)));
        assert!(include_str!("mark_unknown.lua")
            .contains(&format!("'\\{}' .. {splice}", codec::STATE_UNKNOWN)));
        assert!(include_str!("renew.lua").contains(&format!(
            "string.sub(v, 1, {}) .. ARGV[2] .. string.sub(v, {})",
            codec::HEADER_LEN + 16,
            codec::PENDING_LEN + 1
        )));
        assert!(include_str!("watch.lua").contains(&format!(
            "string.byte(v, {}) ~= 1 then redis.call('SETRANGE', KEYS[1], {}, '\\1')",
            codec::PENDING_LEN + 1,
            codec::PENDING_LEN
        )));
        // The origin after a pending record's flag follows it into the unknown state.
        assert!(include_str!("mark_unknown.lua").contains(&format!(
            "ARGV[2] .. string.sub(v, {})",
            codec::PENDING_LEN + 2
        )));
    }
}
