//! The storage folder: account keys, certificates and their keys, the local CA, pending
//! HTTP-01 answers and lock files. Every file is written whole (a temporary file renamed over
//! the old one, so a reader never sees half of one) with permissions 0600 in folders of 0700;
//! several instances may share the folder (a volume they all mount). Blocking calls: the
//! manager runs them on a blocking thread.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::pki::ca::Pem;

/// Files larger than this are not ours (a chain is a few KiB).
const MAX_FILE: u64 = 1 << 20;

fn ctx(path: &Path, what: &str, e: std::io::Error) -> String {
    format!("{}: cannot {what}: {e}", path.display())
}

/// Makes `dir` and its parents (0700: keys live there).
pub fn folder(dir: &Path) -> Result<(), String> {
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(|e| ctx(dir, "make the folder", e))
}

/// Writes `bytes` to `path` whole, 0600, through a temporary file renamed over it.
pub fn write(path: &Path, bytes: &[u8]) -> Result<(), String> {
    if let Some(dir) = path.parent() {
        folder(dir)?;
    }
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = path.with_file_name(format!(".{name}.{}.{:08x}.tmp", std::process::id(), fastrand::u32(..)));
    let written = (|| {
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(ctx(path, "write", e));
    }
    Ok(())
}

/// The file at `path`, or `None` when there is none.
pub fn read(path: &Path) -> Result<Option<Vec<u8>>, String> {
    use std::io::Read;
    match std::fs::File::open(path) {
        Ok(f) => {
            let mut buf = Vec::new();
            f.take(MAX_FILE + 1).read_to_end(&mut buf).map_err(|e| ctx(path, "read", e))?;
            if buf.len() as u64 > MAX_FILE {
                return Err(format!("{}: larger than {MAX_FILE} bytes", path.display()));
            }
            Ok(Some(buf))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(ctx(path, "read", e)),
    }
}

fn read_text(path: &Path) -> Result<Option<String>, String> {
    read(path)?.map(|b| String::from_utf8(b).map_err(|_| format!("{}: not text", path.display()))).transpose()
}

/// A certificate folder's chain and key (`cert.pem`, `key.pem`), if both are there.
pub fn read_pair(dir: &Path) -> Result<Option<Pem>, String> {
    let (Some(chain), Some(key)) = (read_text(&dir.join("cert.pem"))?, read_text(&dir.join("key.pem"))?) else {
        return Ok(None);
    };
    Ok(Some(Pem { chain, key }))
}

/// Stores a chain and its key in `dir`: the key first, so a reader that sees the new chain
/// finds its key (a reader checks that they belong together and waits for the pair).
pub fn write_pair(dir: &Path, pem: &Pem) -> Result<(), String> {
    write(&dir.join("key.pem"), pem.key.as_bytes())?;
    write(&dir.join("cert.pem"), pem.chain.as_bytes())
}

/// The local CA of a storage folder: `local-ca/root.pem` and `local-ca/root.key`.
pub fn local_ca_paths(storage: &Path) -> (PathBuf, PathBuf) {
    let dir = crate::config::managed::local_ca_folder(storage);
    (dir.join("root.pem"), dir.join("root.key"))
}

/// The local CA stored under `storage`, made (and stored) when there is none yet; `now` in
/// unix seconds. Two instances making one at once: each writes its own, the last rename
/// wins, and the other's next read finds the winner (their leaves were signed by a root no
/// one keeps: they are re-issued).
pub fn local_ca(storage: &Path, now: i64) -> Result<crate::pki::ca::LocalCa, String> {
    let (root, key) = local_ca_paths(storage);
    if let (Some(r), Some(k)) = (read_text(&root)?, read_text(&key)?) {
        return crate::pki::ca::LocalCa::load(&r, &k).map_err(|e| format!("{}: {e}", root.display()));
    }
    let (ca, key_pem) = crate::pki::ca::LocalCa::create(now)?;
    write(&key, key_pem.as_bytes())?;
    write(&root, ca.root_pem.as_bytes())?;
    tracing::info!(root = %root.display(), "made a local CA; `tollgate trust` installs its root");
    Ok(ca)
}

/// Whether `token` can name an HTTP-01 answer: base64url, as ACME tokens are (RFC 8555
/// §8.3: at least 128 bits), bounded; nothing else reaches a file name.
pub fn valid_token(token: &str) -> bool {
    (16..=128).contains(&token.len()) && token.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn temp() -> PathBuf {
        let p = std::env::temp_dir().join(format!("tollgate-storage-{}-{:08x}", std::process::id(), fastrand::u32(..)));
        std::fs::create_dir_all(&p).unwrap();
        p
    }

    #[test]
    fn files_are_private_and_replaced_whole() {
        let dir = temp();
        let file = dir.join("a/b/key.pem");
        write(&file, b"one").unwrap();
        write(&file, b"two").unwrap();
        assert_eq!(read(&file).unwrap().unwrap(), b"two");
        assert_eq!(std::fs::metadata(&file).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(std::fs::metadata(dir.join("a/b")).unwrap().permissions().mode() & 0o777, 0o700);
        let left: Vec<_> = std::fs::read_dir(dir.join("a/b")).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, ["key.pem"], "no temporary file is left");
        assert_eq!(read(&dir.join("none")).unwrap(), None);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn the_local_ca_is_made_once_and_kept() {
        let dir = temp();
        let a = local_ca(&dir, 1_800_000_000).unwrap();
        let b = local_ca(&dir, 1_800_000_100).unwrap();
        assert_eq!(a.root_pem, b.root_pem);
        let (_, key) = local_ca_paths(&dir);
        assert_eq!(std::fs::metadata(key).unwrap().permissions().mode() & 0o777, 0o600);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn only_token_shaped_names_reach_a_file_name() {
        assert!(valid_token("LoqXcYV8q5ONbJQxbmR7SCTNo3tiAXDfowyjxAjEuX0"));
        for bad in ["", "../../etc/passwd", "a/b", "short", &"x".repeat(129), "tok.en.tok.en.tok.en"] {
            assert!(!valid_token(bad), "{bad}");
        }
    }
}
