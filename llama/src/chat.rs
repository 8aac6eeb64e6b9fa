//! Chat templates: the Jinja text stored with the model (`tokenizer.chat_template` in GGUF
//! metadata, `chat_template` in `tokenizer_config.json`), rendered with minijinja the way
//! Hugging Face's `apply_chat_template` renders it.

use candle_core::Result;
use serde::Serialize;

#[derive(Clone, Debug, Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into() }
    }
}

/// Renders `template` over `messages` with the variables Hugging Face passes
/// (`messages`, `add_generation_prompt`, `bos_token`, `eos_token`) and its
/// `raise_exception` helper, which many templates call on unsupported input.
pub fn apply_chat_template(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String> {
    let err = |e: minijinja::Error| candle_core::Error::Msg(format!("chat template: {e:#}"));
    let mut env = minijinja::Environment::new();
    // HF renders with trim_blocks and lstrip_blocks; templates are written for that.
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
        Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
    });
    env.add_template("chat", template).map_err(err)?;
    let ctx = minijinja::context! {
        messages => messages,
        add_generation_prompt => add_generation_prompt,
        bos_token => bos_token,
        eos_token => eos_token,
    };
    env.get_template("chat").and_then(|t| t.render(ctx)).map_err(err)
}
