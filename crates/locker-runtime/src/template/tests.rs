use super::build::*;
use super::extract::*;
use super::fsutil::*;
use super::spec::*;

#[test]
fn names_follow_the_pattern() {
    for ok in ["default", "a", "0", "py3.11_x-y", &"a".repeat(63)] {
        assert!(validate_name(ok).is_ok(), "{ok}");
    }
    for bad in [
        "",
        "Default",
        ".x",
        "-x",
        "_x",
        "a/b",
        "a b",
        "é",
        &"a".repeat(64),
    ] {
        assert!(validate_name(bad).is_err(), "{bad}");
    }
}

#[test]
fn packages_follow_debian_policy() {
    for ok in ["jq", "g++", "python3.11", "libc6-dev", "0ad"] {
        assert!(validate_package(ok).is_ok(), "{ok}");
    }
    for bad in ["a", "Jq", "-x", "x;rm", "x y", "x=1.0", "x/bookworm", ""] {
        assert!(validate_package(bad).is_err(), "{bad}");
    }
}

#[test]
fn mmdebstrap_phases_move_the_bar() {
    let mut p = MmdebstrapPhases::default();
    assert_eq!(p.line("I: automatically chosen mode: root"), None);
    assert_eq!(
        p.line("I: downloading packages with apt..."),
        Some(Event::Step("downloading essential packages", 0.04))
    );
    assert_eq!(
        p.line("0 upgraded, 4 newly installed, 0 to remove and 0 not upgraded."),
        None
    );
    let Some(Event::Fraction(f)) =
        p.line("Get:1 http://deb.debian.org/debian bookworm/main amd64 x")
    else {
        panic!("Get: lines count");
    };
    assert!((f - 0.06).abs() < 1e-9, "{f}");
    assert!(matches!(
        p.line("I: installing essential packages..."),
        Some(Event::Step(_, _))
    ));
    assert_eq!(p.line("Selecting previously unselected package x."), None);
    assert!(
        matches!(p.line("Unpacking x (1.0) ..."), Some(Event::Fraction(f)) if f > 0.18 && f < 0.35)
    );
}

#[test]
fn mountinfo_escapes_are_undone() {
    assert_eq!(unescape_mountinfo(r"/a\040b/c\134d"), "/a b/c\\d");
    assert_eq!(unescape_mountinfo(r"/plain\04"), r"/plain\04");
}

#[test]
fn compression_is_detected_by_magic() {
    assert_eq!(compression_flag(&[0x1f, 0x8b, 8, 0, 0, 0]), Some("--gzip"));
    assert_eq!(
        compression_flag(&[0xfd, b'7', b'z', b'X', b'Z', 0]),
        Some("--xz")
    );
    assert_eq!(
        compression_flag(&[0x28, 0xb5, 0x2f, 0xfd, 0, 0]),
        Some("--zstd")
    );
    assert_eq!(compression_flag(b"BZh91A"), Some("--bzip2"));
    assert_eq!(compression_flag(b"etc/\0\0"), None);
}

#[test]
fn the_code_interpreter_spec_is_default_with_a_jupyter_kernel() {
    let spec = builtin_spec("code-interpreter").unwrap();
    assert_eq!(spec.name, "code-interpreter");
    assert!(spec.validate().is_ok());
    for p in super::DEFAULT_PACKAGES
        .iter()
        .chain(super::CODE_INTERPRETER_PACKAGES)
    {
        assert!(spec.packages.iter().any(|q| q == p), "{p}");
    }
    assert_eq!(spec.run, [super::DEFAULT_USER_STEP]);
    assert_ne!(spec.digest(), default_spec().digest());
    assert_eq!(builtin_spec("default").unwrap(), default_spec());
    assert!(builtin_spec("other").is_none());
}
