//! The database URL from AWS Secrets Manager, read once at cold start when
//! `ROWQ_DATABASE_SECRET_ARN` is set instead of `DATABASE_URL` (the deployed Lambdas).
//!
//! The secret may hold a URL (`postgres://...`), a JSON object with a `url`, or the JSON that
//! RDS writes for a managed secret (`username`, `password`, `host`, `port`, `dbname`).

use serde::Deserialize;

use crate::config::DatabaseConfig;

#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("cannot read the database secret {arn}: {detail}")]
    Read { arn: String, detail: String },
    #[error("the database secret {arn} holds neither a postgres:// URL nor JSON with url or username/password/host")]
    Format { arn: String },
}

/// Fills `database.url` from the secret when one is configured; otherwise leaves it alone.
pub async fn resolve(database: &mut DatabaseConfig) -> Result<(), SecretError> {
    let Some(arn) = database.secret_arn.clone() else {
        return Ok(());
    };
    let config = crate::sqs::aws_config().load().await;
    let client = aws_sdk_secretsmanager::Client::new(&config);
    let output = client.get_secret_value().secret_id(&arn).send().await.map_err(|e| SecretError::Read {
        arn: arn.clone(),
        detail: aws_sdk_secretsmanager::error::DisplayErrorContext(e).to_string(),
    })?;
    let text = output.secret_string().ok_or_else(|| SecretError::Format { arn: arn.clone() })?;
    database.url = url_from_secret(text).ok_or(SecretError::Format { arn })?;
    Ok(())
}

#[derive(Deserialize)]
struct RdsSecret {
    url: Option<String>,
    username: Option<String>,
    password: Option<String>,
    host: Option<String>,
    port: Option<serde_json::Value>,
    dbname: Option<String>,
}

/// The database URL a secret's text describes.
pub fn url_from_secret(text: &str) -> Option<String> {
    let text = text.trim();
    if text.starts_with("postgres://") || text.starts_with("postgresql://") {
        return Some(text.to_string());
    }
    let secret: RdsSecret = serde_json::from_str(text).ok()?;
    if let Some(url) = secret.url {
        return Some(url);
    }
    let port = match secret.port {
        Some(serde_json::Value::Number(n)) => n.to_string(),
        Some(serde_json::Value::String(s)) => s,
        _ => "5432".to_string(),
    };
    Some(format!(
        "postgres://{}:{}@{}:{port}/{}",
        encode(&secret.username?),
        encode(&secret.password?),
        secret.host?,
        secret.dbname.unwrap_or_else(|| "postgres".to_string())
    ))
}

/// Percent-encodes everything but unreserved characters (RFC 3986), for userinfo.
fn encode(part: &str) -> String {
    part.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_url_secret_is_used_as_is() {
        assert_eq!(url_from_secret(" postgres://a:b@h/db\n").as_deref(), Some("postgres://a:b@h/db"));
    }

    #[test]
    fn a_json_secret_with_a_url_uses_it() {
        assert_eq!(url_from_secret(r#"{"url":"postgres://x@y/z"}"#).as_deref(), Some("postgres://x@y/z"));
    }

    #[test]
    fn an_rds_managed_secret_becomes_a_url_with_its_password_encoded() {
        let secret = r#"{"engine":"postgres","username":"rowq","password":"p@ss/w:rd","host":"db.example","port":5432,"dbname":"jobs"}"#;
        assert_eq!(url_from_secret(secret).as_deref(), Some("postgres://rowq:p%40ss%2Fw%3Ard@db.example:5432/jobs"));
    }

    #[test]
    fn a_secret_without_what_is_needed_is_refused() {
        assert_eq!(url_from_secret(r#"{"username":"rowq"}"#), None);
        assert_eq!(url_from_secret("hunter2"), None);
    }
}
