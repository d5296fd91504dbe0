//! A template spec (base, packages, run steps) and its digest, and the names rules.

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use super::fsutil::*;
use super::*;

/// What to build: a base, apt packages, and shell steps run as root inside the result.
///
/// The JSON form is the spec file `locker template build --file` reads; unknown fields are
/// refused so that a typo does not silently build something else.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TemplateSpec {
    /// The name the template is found by; not part of its digest.
    pub name: String,
    /// The distribution it starts from; only `debian:bookworm` for now.
    #[serde(default = "default_base")]
    pub base: String,
    /// Debian packages to install on top of the minimal system.
    #[serde(default)]
    pub packages: Vec<String>,
    /// Shell scripts (`/bin/sh -c`), run in order as root inside the new root filesystem.
    #[serde(default)]
    pub run: Vec<String>,
}

pub(super) fn default_base() -> String {
    DEFAULT_BASE.to_string()
}

/// The canonical content of a spec: what its digest hashes.
#[derive(Serialize)]
pub(super) struct CanonicalSpec<'a> {
    pub(super) format: &'a str,
    pub(super) base: &'a str,
    pub(super) packages: Vec<&'a str>,
    pub(super) run: &'a [String],
}

impl TemplateSpec {
    /// Reads a spec from its JSON form and validates it.
    pub fn from_json(text: &str) -> Result<Self, TemplateError> {
        let spec: Self =
            serde_json::from_str(text).map_err(|e| TemplateError::InvalidSpec(e.to_string()))?;
        spec.validate()?;
        Ok(spec)
    }

    /// Checks the name, base, package names and run steps.
    pub fn validate(&self) -> Result<(), TemplateError> {
        validate_name(&self.name)?;
        if self.base != DEFAULT_BASE {
            return Err(TemplateError::UnsupportedBase(self.base.clone()));
        }
        for p in &self.packages {
            validate_package(p)?;
        }
        for (i, step) in self.run.iter().enumerate() {
            if step.trim().is_empty() {
                return Err(TemplateError::InvalidSpec(format!(
                    "run step {} is empty",
                    i + 1
                )));
            }
            if step.contains('\0') {
                return Err(TemplateError::InvalidSpec(format!(
                    "run step {} contains a NUL byte",
                    i + 1
                )));
            }
        }
        Ok(())
    }

    /// The content digest (64 hex digits): sha256 of the canonical form, which sorts and
    /// de-duplicates packages (apt does not care about their order) but keeps run steps in
    /// order, and leaves the name out.
    pub fn digest(&self) -> String {
        let mut packages: Vec<&str> = self.packages.iter().map(String::as_str).collect();
        packages.sort_unstable();
        packages.dedup();
        let canonical = CanonicalSpec {
            format: SPEC_FORMAT,
            base: &self.base,
            packages,
            run: &self.run,
        };
        let bytes = serde_json::to_vec(&canonical).expect("a spec always serializes");
        hex(&Sha256::digest(&bytes))
    }
}

/// The spec of the `default` template: Debian bookworm with Python, Node, git and the
/// usual command-line tools, and the account [`DEFAULT_USER`] (E2B's SDKs expect it).
pub fn default_spec() -> TemplateSpec {
    TemplateSpec {
        name: DEFAULT_TEMPLATE.to_string(),
        base: DEFAULT_BASE.to_string(),
        packages: DEFAULT_PACKAGES.iter().map(|p| p.to_string()).collect(),
        run: vec![DEFAULT_USER_STEP.to_string()],
    }
}

/// The spec of the `code-interpreter` template: `default`'s packages and Jupyter's Python
/// kernel with numpy, pandas, matplotlib, scipy, requests and pillow.
pub fn code_interpreter_spec() -> TemplateSpec {
    let mut spec = default_spec();
    spec.name = CODE_INTERPRETER_TEMPLATE.to_string();
    spec.packages
        .extend(CODE_INTERPRETER_PACKAGES.iter().map(|p| p.to_string()));
    spec
}

/// The spec of a template Locker knows by name (`default`, `code-interpreter`).
pub fn builtin_spec(name: &str) -> Option<TemplateSpec> {
    match name {
        DEFAULT_TEMPLATE => Some(default_spec()),
        CODE_INTERPRETER_TEMPLATE => Some(code_interpreter_spec()),
        _ => None,
    }
}

/// Checks a template name: `[a-z0-9][a-z0-9._-]{0,62}`.
pub fn validate_name(name: &str) -> Result<(), TemplateError> {
    let bad = |why| {
        Err(TemplateError::InvalidName {
            name: name.to_string(),
            why,
        })
    };
    let Some(first) = name.bytes().next() else {
        return bad("it is empty");
    };
    if name.len() > 63 {
        return bad("it is longer than 63 characters");
    }
    if !(first.is_ascii_lowercase() || first.is_ascii_digit()) {
        return bad("it must start with a lowercase letter or a digit");
    }
    let ok = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b);
    if !name.bytes().all(ok) {
        return bad("use only lowercase letters, digits, '.', '_' and '-'");
    }
    Ok(())
}

/// Checks a Debian package name (Debian Policy 5.6.1): `[a-z0-9][a-z0-9+.-]+`.
pub(super) fn validate_package(p: &str) -> Result<(), TemplateError> {
    let ok = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b"+.-".contains(&b);
    let first_ok = p
        .bytes()
        .next()
        .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    if p.len() < 2 || p.len() > 128 || !first_ok || !p.bytes().all(ok) {
        return Err(TemplateError::InvalidSpec(format!(
            "{p:?} is not a Debian package name (lowercase letters, digits, '+', '-', '.'; \
             at least two characters, starting with a letter or digit)"
        )));
    }
    Ok(())
}
