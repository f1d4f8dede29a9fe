//! `tollgate trust`: the root of tollgate's local development CA (`tls: { internal: true }`),
//! printed as PEM, or installed where the system and the browsers look for trusted roots.
//! The CA is made on first use, as `tollgate run` would make it, so a machine can trust it
//! before the proxy first starts.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::config::{CertSource, Config};

/// Where the local CA lives: the storage of the config's first `tls.internal`, else the
/// default storage folder.
pub fn storage(config: Option<&Config>) -> PathBuf {
    let from_config = config.and_then(|c| {
        c.listeners.iter().filter_map(|l| l.tls.as_ref()).flat_map(|t| &t.managed).find_map(|m| match &m.source {
            CertSource::Internal(i) => Some(i.storage.clone()),
            CertSource::Acme(_) => None,
        })
    });
    from_config.unwrap_or_else(crate::config::managed::default_storage)
}

/// The root of the local CA under `storage` (made there if there is none), as PEM, and the
/// path of its file.
///
/// # Errors
/// The storage cannot be read or written.
pub fn root(storage: &Path) -> Result<(String, PathBuf), String> {
    let ca = crate::acme::storage::local_ca(storage, crate::acme::unix_now())?;
    let (path, _) = crate::acme::storage::local_ca_paths(storage);
    Ok((ca.root_pem, path))
}

/// What `tollgate trust` prints: the root (or what `install` did) on standard output, and a
/// note for standard error. `storage` wins over the config; the config file is read when it
/// exists (a missing default `proxy.yaml` means the default storage).
///
/// # Errors
/// The config is invalid, the storage unusable, or nothing could be installed.
pub fn command(config_file: &Path, storage_flag: Option<&Path>, install_it: bool) -> Result<(String, String), String> {
    let folder = match storage_flag {
        Some(s) => s.to_owned(),
        None if config_file.exists() => storage(Some(&Config::load(config_file).map_err(|e| e.to_string())?)),
        None => storage(None),
    };
    let (pem, file) = root(&folder)?;
    if !install_it {
        let note = format!(
            "the local CA's root ({}); `tollgate trust --install` adds it to the system's and the browsers' trusted roots\n",
            file.display()
        );
        return Ok((pem, note));
    }
    let home = std::env::var_os("HOME").map(PathBuf::from);
    let out = install(&pem, &file, SystemStore::detect().as_ref(), home.as_deref())?;
    Ok((out, String::new()))
}

/// Where one kind of system keeps the roots it trusts, and the command that reads them again.
pub struct SystemStore {
    /// The folder the root is copied into.
    pub folder: PathBuf,
    /// The file name extension that folder wants.
    pub extension: &'static str,
    pub refresh: Vec<String>,
}

impl SystemStore {
    /// Debian, Ubuntu, Alpine (`update-ca-certificates`), or Fedora, RHEL, Arch
    /// (`update-ca-trust`): the first whose folder exists.
    pub fn detect() -> Option<SystemStore> {
        let candidates = [
            ("/usr/local/share/ca-certificates", "crt", vec!["update-ca-certificates".to_owned()]),
            ("/etc/pki/ca-trust/source/anchors", "pem", vec!["update-ca-trust".to_owned(), "extract".to_owned()]),
            ("/etc/ca-certificates/trust-source/anchors", "crt", vec!["trust".to_owned(), "extract-compat".to_owned()]),
        ];
        candidates
            .into_iter()
            .find(|(dir, _, _)| Path::new(dir).is_dir())
            .map(|(dir, extension, refresh)| SystemStore { folder: PathBuf::from(dir), extension, refresh })
    }
}

/// A short name of the root, the same on every run: its file name in trust stores.
fn nickname(root_pem: &str) -> String {
    format!("tollgate-local-ca-{:08x}", xxhash_rust::xxh3::xxh3_64(root_pem.as_bytes()) as u32)
}

/// Installs `root_pem` into `system` (copy and refresh) and into the browsers' NSS databases
/// found under `home` (Chromium's `~/.pki/nssdb`, Firefox profiles) when `certutil` exists;
/// what was done, line by line. A step that fails is said and the others still run.
///
/// # Errors
/// Nothing could be installed anywhere.
pub fn install(
    root_pem: &str,
    root_file: &Path,
    system: Option<&SystemStore>,
    home: Option<&Path>,
) -> Result<String, String> {
    let name = nickname(root_pem);
    let mut done = Vec::new();
    let mut failed = Vec::new();
    match system {
        None => failed.push(
            "no system trust store found (looked for update-ca-certificates' and update-ca-trust's folders)".to_owned(),
        ),
        Some(s) => {
            let target = s.folder.join(format!("{name}.{}", s.extension));
            match std::fs::write(&target, root_pem) {
                Err(e) => failed.push(format!("{}: {e} (run as root, e.g. with sudo)", target.display())),
                Ok(()) => match run(&s.refresh) {
                    Ok(()) => done.push(format!("system: {} and `{}`", target.display(), s.refresh.join(" "))),
                    Err(e) => failed.push(format!(
                        "system: copied to {}, but `{}` failed: {e}",
                        target.display(),
                        s.refresh.join(" ")
                    )),
                },
            }
        }
    }
    for db in home.map(nss_databases).unwrap_or_default() {
        let args = [
            "-A".to_owned(),
            "-d".to_owned(),
            format!("sql:{}", db.display()),
            "-t".to_owned(),
            "C,,".to_owned(),
            "-n".to_owned(),
            name.clone(),
            "-i".to_owned(),
            root_file.display().to_string(),
        ];
        let mut cmd = vec!["certutil".to_owned()];
        cmd.extend(args);
        match run(&cmd) {
            Ok(()) => done.push(format!("browser: {}", db.display())),
            Err(e) => {
                failed.push(format!("browser database {}: {e} (install libnss3-tools for certutil)", db.display()))
            }
        }
    }
    let mut out = String::new();
    for d in &done {
        out.push_str(&format!("installed: {d}\n"));
    }
    for f in &failed {
        out.push_str(&format!("not installed: {f}\n"));
    }
    if done.is_empty() {
        return Err(out);
    }
    Ok(out)
}

/// The NSS databases of Chromium (`~/.pki/nssdb`) and of Firefox's profiles under `home`.
fn nss_databases(home: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let chromium = home.join(".pki/nssdb");
    if chromium.join("cert9.db").exists() {
        out.push(chromium);
    }
    for root in [home.join(".mozilla/firefox"), home.join("snap/firefox/common/.mozilla/firefox")] {
        let Ok(entries) = std::fs::read_dir(&root) else { continue };
        let mut profiles: Vec<PathBuf> =
            entries.filter_map(Result::ok).map(|e| e.path()).filter(|p| p.join("cert9.db").exists()).collect();
        profiles.sort();
        out.extend(profiles);
    }
    out
}

fn run(cmd: &[String]) -> Result<(), String> {
    let (program, args) = cmd.split_first().ok_or("no command")?;
    let status = Command::new(program).args(args).status().map_err(|e| format!("`{program}`: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("`{}` exited with {status}", cmd.join(" ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(tag: &str) -> PathBuf {
        let p =
            std::env::temp_dir().join(format!("tollgate-trust-{tag}-{}-{:08x}", std::process::id(), fastrand::u32(..)));
        std::fs::create_dir_all(&p).unwrap();
        p
    }

    #[test]
    fn install_copies_the_root_and_refreshes_the_store() {
        let storage = temp("storage");
        let folder = temp("anchors");
        let (pem, file) = root(&storage).unwrap();
        let store = SystemStore { folder: folder.clone(), extension: "crt", refresh: vec!["true".to_owned()] };
        let out = install(&pem, &file, Some(&store), None).unwrap();
        let copied = folder.join(format!("{}.crt", nickname(&pem)));
        assert_eq!(std::fs::read_to_string(&copied).unwrap(), pem);
        assert!(out.starts_with("installed: system: "), "{out}");
        // The same root the second time: one file, the same name.
        install(&pem, &file, Some(&store), None).unwrap();
        assert_eq!(std::fs::read_dir(&folder).unwrap().count(), 1);
        let failing = SystemStore { folder: folder.clone(), extension: "crt", refresh: vec!["false".to_owned()] };
        let err = install(&pem, &file, Some(&failing), None).unwrap_err();
        assert!(err.contains("not installed: system: copied to"), "{err}");
        assert!(install(&pem, &file, None, None).is_err());
        for d in [storage, folder] {
            std::fs::remove_dir_all(d).unwrap();
        }
    }
}
