//! Creates `email` jobs for the worker example: `N` of them (default 10), every
//! tenth without a recipient, so that it fails.
//!
//! ```sh
//! cargo run -p courier-client --example producer -- 100
//! ```
//! The gateway address comes from `COURIER_ADDRESS` (default `127.0.0.1:26500`).

use courier_client::{Client, NewJob};
use serde_json::json;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let address = std::env::var("COURIER_ADDRESS").unwrap_or_else(|_| "127.0.0.1:26500".into());
    let count: usize = match std::env::args().nth(1) {
        Some(n) => n.parse()?,
        None => 10,
    };
    let client = Client::connect(&address)?;
    for i in 0..count {
        let variables = if i % 10 == 9 {
            json!({ "subject": "lost" })
        } else {
            json!({ "to": format!("user{i}@example.com"), "subject": "hello" })
        };
        let created = client
            .create_job(NewJob::new("email").variables(variables).retries(3))
            .await?;
        println!(
            "created job {} on partition {}",
            created.key, created.partition_id
        );
    }
    Ok(())
}
