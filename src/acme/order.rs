//! One ACME account and one order (RFC 8555) on instant-acme: the account made once and kept
//! in the storage, each name's challenge answered (HTTP-01 from memory and from the shared
//! storage, TLS-ALPN-01 from the listener's certificate resolver), the CSR rcgen made, the
//! chain fetched. The answers are withdrawn when the order ends, however it ends.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use instant_acme::{
    Account, AccountCredentials, AuthorizationStatus, ChallengeType, ExternalAccountKey, Identifier, NewAccount,
    NewOrder, OrderStatus, RetryPolicy,
};

use crate::config::managed::Acme;
use crate::config::Challenge;
use crate::pki::ca::Pem;
use crate::pki::issued::Issued;

/// How long the CA may take to validate every name, and then to issue.
const VALIDATION: Duration = Duration::from_secs(90);

/// The folder of one directory's account, answers and certificates: `<storage>/acme/<dir>`.
pub fn directory_folder(acme: &Acme, id: &str) -> PathBuf {
    // The id is `acme/<dir>/<names>`: its parent is the directory's folder.
    let dir = Path::new(id).parent().unwrap_or(Path::new("acme"));
    acme.storage.join(dir)
}

/// Where an instance puts an HTTP-01 answer for the others to serve (they share `storage`).
pub fn answer_file(directory: &Path, token: &str) -> PathBuf {
    directory.join("challenges").join(token)
}

/// The account of `acme`'s directory, read from `folder/account.json` or made there.
///
/// # Errors
/// The server refused to make the account, or the storage cannot be read or written.
pub async fn account(acme: &Acme, folder: &Path) -> Result<Account, String> {
    let client =
        || super::client::Client::new(acme.directory_roots.as_ref()).map(|c| Account::builder_with_http(Box::new(c)));
    let file = folder.join("account.json");
    let stored = {
        let file = file.clone();
        tokio::task::spawn_blocking(move || super::storage::read(&file)).await.map_err(|e| e.to_string())??
    };
    if let Some(bytes) = stored {
        let creds: AccountCredentials =
            serde_json::from_slice(&bytes).map_err(|e| format!("{}: not an account ({e})", file.display()))?;
        return client()?.from_credentials(creds).await.map_err(|e| format!("{}: {e}", acme.directory));
    }
    let contact = acme.email.as_ref().map(|e| format!("mailto:{e}"));
    let contacts: Vec<&str> = contact.iter().map(String::as_str).collect();
    let new = NewAccount { contact: &contacts, terms_of_service_agreed: true, only_return_existing: false };
    let eab = acme.eab.as_ref().and_then(|e| Some(ExternalAccountKey::new(e.kid.clone(), e.key.as_deref()?)));
    let (account, creds) = client()?
        .create(&new, acme.directory.clone(), eab.as_ref())
        .await
        .map_err(|e| format!("{}: the account could not be made: {e}", acme.directory))?;
    let json = serde_json::to_vec(&creds).map_err(|e| e.to_string())?;
    tokio::task::spawn_blocking(move || super::storage::write(&file, &json)).await.map_err(|e| e.to_string())??;
    tracing::info!(directory = %acme.directory, "made an ACME account");
    Ok(account)
}

/// An answer published for one name, withdrawn when the order ends.
enum Published {
    Http { token: String, file: PathBuf },
    Alpn { name: String },
}

/// Orders a certificate for `names` and returns it with its new key.
///
/// # Errors
/// What the CA said (a failed validation names the name and the reason), or a network error.
pub async fn order(
    account: &Account,
    names: &[String],
    challenge: Challenge,
    issued: &Arc<Issued>,
    directory: &Path,
) -> Result<Pem, String> {
    let mut published = Vec::new();
    let result = run(account, names, challenge, issued, directory, &mut published).await;
    for p in published {
        match p {
            Published::Http { token, file } => {
                issued.forget_http(&token);
                let _ = tokio::task::spawn_blocking(move || std::fs::remove_file(file)).await;
            }
            Published::Alpn { name } => issued.forget_alpn(&name),
        }
    }
    result
}

async fn run(
    account: &Account,
    names: &[String],
    challenge: Challenge,
    issued: &Arc<Issued>,
    directory: &Path,
    published: &mut Vec<Published>,
) -> Result<Pem, String> {
    let ids: Vec<Identifier> = names.iter().map(|n| Identifier::Dns(n.clone())).collect();
    let mut order = account.new_order(&NewOrder::new(&ids)).await.map_err(|e| format!("new order: {e}"))?;
    let kind = match challenge {
        Challenge::Http01 => ChallengeType::Http01,
        Challenge::TlsAlpn01 => ChallengeType::TlsAlpn01,
    };
    let mut authorizations = order.authorizations();
    while let Some(authz) = authorizations.next().await {
        let mut authz = authz.map_err(|e| format!("authorization: {e}"))?;
        let name = authz.identifier().to_string();
        match authz.status {
            AuthorizationStatus::Pending => {}
            // Validated before (by this account, recently): nothing to answer.
            AuthorizationStatus::Valid => continue,
            other => return Err(format!("{name}: the authorization is {other:?}")),
        }
        let mut handle = authz
            .challenge(kind.clone())
            .ok_or_else(|| format!("{name}: the CA offers no {} challenge", challenge.as_str()))?;
        let key_authorization = handle.key_authorization();
        match challenge {
            Challenge::Http01 => {
                let token = handle.token.clone();
                if !super::storage::valid_token(&token) {
                    return Err(format!("{name}: the CA's token is not base64url"));
                }
                issued.answer_http(&token, key_authorization.as_str());
                // For the other instances behind the same address: they share the storage.
                let file = answer_file(directory, &token);
                let (path, text) = (file.clone(), key_authorization.as_str().to_owned());
                published.push(Published::Http { token, file });
                tokio::task::spawn_blocking(move || super::storage::write(&path, text.as_bytes()))
                    .await
                    .map_err(|e| e.to_string())??;
            }
            Challenge::TlsAlpn01 => {
                let cert =
                    crate::pki::ca::alpn_challenge(&name, key_authorization.digest().as_ref(), super::unix_now())?;
                issued.answer_alpn(&name, Arc::new(cert));
                published.push(Published::Alpn { name: name.clone() });
            }
        }
        handle.set_ready().await.map_err(|e| format!("{name}: {e}"))?;
    }
    let policy = RetryPolicy::new().initial_delay(Duration::from_millis(250)).timeout(VALIDATION);
    let status = match order.poll_ready(&policy).await {
        Ok(s) => s,
        Err(e) => return Err(why_invalid(&mut order).await.unwrap_or_else(|| format!("validation: {e}"))),
    };
    if status != OrderStatus::Ready {
        return Err(why_invalid(&mut order).await.unwrap_or_else(|| format!("the order is {status:?}")));
    }
    let (csr, key) = crate::pki::ca::csr(names)?;
    order.finalize_csr(&csr).await.map_err(|e| format!("finalize: {e}"))?;
    let chain = order.poll_certificate(&policy).await.map_err(|e| format!("certificate: {e}"))?;
    Ok(Pem { chain, key })
}

/// The validation errors of a failed order, name by name, as the CA gave them.
async fn why_invalid(order: &mut instant_acme::Order) -> Option<String> {
    let mut out = Vec::new();
    let mut authorizations = order.authorizations();
    while let Some(Ok(mut authz)) = authorizations.next().await {
        let Ok(state) = authz.refresh().await else { continue };
        let name = state.identifier().to_string();
        for c in &state.challenges {
            if let Some(e) = &c.error {
                out.push(format!("{name}: {e}"));
            }
        }
    }
    (!out.is_empty()).then(|| out.join("; "))
}
