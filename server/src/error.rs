//! API errors in OpenAI's shape: `{"error": {"message", "type", "param",
//! "code"}}` with the matching HTTP status.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param: None,
            code: None,
        }
    }

    pub fn bad_param(param: &str, message: impl Into<String>) -> Self {
        ApiError {
            param: Some(param.to_string()),
            ..ApiError::bad_request(message)
        }
    }

    pub fn unauthorized() -> Self {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            kind: "invalid_request_error",
            message: "Incorrect or missing API key: send `Authorization: Bearer <key>`".into(),
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    pub fn model_not_found(model: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            message: format!("The model `{model}` does not exist"),
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }

    pub fn not_found(path: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            message: format!("Unknown endpoint `{path}`"),
            param: None,
            code: Some("not_found"),
        }
    }

    pub fn overloaded() -> Self {
        ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            kind: "rate_limit_exceeded",
            message: "The server's request queue is full; retry shortly".into(),
            param: None,
            code: Some("queue_full"),
        }
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "server_error",
            message: message.into(),
            param: None,
            code: Some("unavailable"),
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            message: message.into(),
            param: None,
            code: None,
        }
    }

    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS
            || self.status == StatusCode::SERVICE_UNAVAILABLE
        {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        r
    }
}

impl From<colibri_model::ModelError> for ApiError {
    fn from(e: colibri_model::ModelError) -> Self {
        use colibri_model::ModelError as E;
        match e {
            E::ContextExceeded { .. }
            | E::TokenOutOfRange { .. }
            | E::ChatTemplate(_)
            | E::Invalid(_) => ApiError::bad_request(e.to_string()),
            other => ApiError::internal(other.to_string()),
        }
    }
}
