//! The unpacker against hand-made layers, hostile ones first, and archive imports into a
//! scratch cache.

use super::unpack::Unpacker;
use super::*;
use flate2::write::GzEncoder;
use sha2::Sha256;
use std::fs;
use std::io::Write;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// A scratch directory with `root/` (the rootfs being built) and `outside/` (the host
/// files a hostile layer aims at), removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(what: &str) -> Self {
        let p =
            std::env::temp_dir().join(format!("locker-image-test-{what}-{}", std::process::id()));
        let _ = locker_sys::fs::remove_tree(&p);
        fs::create_dir_all(p.join("root")).unwrap();
        fs::create_dir_all(p.join("outside")).unwrap();
        Scratch(p)
    }
    fn root(&self) -> PathBuf {
        self.0.join("root")
    }
    fn outside(&self) -> PathBuf {
        self.0.join("outside")
    }
    fn outside_is_empty(&self) -> bool {
        fs::read_dir(self.outside()).unwrap().next().is_none()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = locker_sys::fs::remove_tree(&self.0);
    }
}

/// One tar entry, written with raw header bytes so that any name (`..`, absolute) fits.
struct E {
    name: Vec<u8>,
    kind: u8,
    mode: u32,
    uid: u64,
    link: Vec<u8>,
    data: Vec<u8>,
    size: Option<u64>,
    pax: Vec<(String, Vec<u8>)>,
}

fn e(name: &str, kind: u8) -> E {
    E {
        name: name.as_bytes().to_vec(),
        kind,
        mode: if kind == b'5' { 0o755 } else { 0o644 },
        uid: 0,
        link: Vec::new(),
        data: Vec::new(),
        size: None,
        pax: Vec::new(),
    }
}
fn file(name: &str, data: &[u8]) -> E {
    E {
        data: data.to_vec(),
        ..e(name, b'0')
    }
}
fn dir(name: &str) -> E {
    e(name, b'5')
}
fn link(name: &str, kind: u8, target: &str) -> E {
    E {
        link: target.as_bytes().to_vec(),
        ..e(name, kind)
    }
}

fn header(name: &[u8], kind: u8, size: u64, mode: u32, uid: u64, link: &[u8]) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    {
        let g = h.as_gnu_mut().unwrap();
        g.name[..name.len()].copy_from_slice(name);
        g.linkname[..link.len()].copy_from_slice(link);
    }
    h.set_entry_type(tar::EntryType::new(kind));
    h.set_size(size);
    h.set_mode(mode);
    h.set_uid(uid);
    h.set_gid(uid);
    h.set_mtime(1_700_000_000);
    h.set_cksum();
    h
}

fn layer(entries: &[E]) -> Vec<u8> {
    let mut out = Vec::new();
    for x in entries {
        if !x.pax.is_empty() {
            let mut body = Vec::new();
            for (k, v) in &x.pax {
                let rec_len = |n: usize| k.len() + v.len() + 3 + n;
                let mut n = 1;
                while rec_len(n).to_string().len() != n {
                    n += 1;
                }
                body.extend_from_slice(format!("{} {k}=", rec_len(n)).as_bytes());
                body.extend_from_slice(v);
                body.push(b'\n');
            }
            let h = header(b"PaxHeader", b'x', body.len() as u64, 0o644, 0, b"");
            out.extend_from_slice(h.as_bytes());
            body.resize(body.len().div_ceil(512) * 512, 0);
            out.extend_from_slice(&body);
        }
        let size = x.size.unwrap_or(x.data.len() as u64);
        let h = header(&x.name, x.kind, size, x.mode, x.uid, &x.link);
        out.extend_from_slice(h.as_bytes());
        let mut data = x.data.clone();
        data.resize(data.len().div_ceil(512) * 512, 0);
        out.extend_from_slice(&data);
    }
    out.extend_from_slice(&[0u8; 1024]);
    out
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut g = GzEncoder::new(Vec::new(), flate2::Compression::fast());
    g.write_all(bytes).unwrap();
    g.finish().unwrap()
}

fn limits(unpacked: u64) -> ImageLimits {
    ImageLimits {
        max_download_bytes: 1 << 30,
        max_unpacked_bytes: unpacked,
    }
}

fn apply(s: &Scratch, layers: &[Vec<u8>]) -> Result<(), TemplateError> {
    let mut u = Unpacker::new(&s.root(), limits(64 << 20))?;
    for (i, l) in layers.iter().enumerate() {
        u.apply(&l[..], &format!("layer {}", i + 1), None)?;
    }
    Ok(())
}

fn is_bad(r: Result<(), TemplateError>, needle: &str) {
    match r {
        Err(TemplateError::BadImage(m)) => assert!(m.contains(needle), "{m}"),
        other => panic!("expected a bad image ({needle}), got {other:?}"),
    }
}

#[test]
fn a_layer_keeps_modes_owners_links_fifos_and_user_xattrs() {
    let s = Scratch::new("basic");
    let mut suid = file("usr/bin/su", b"#!/bin/sh\n");
    suid.mode = 0o4755;
    let mut owned = file("home/u/notes", b"hi");
    owned.uid = 1234;
    let mut attrs = file("etc/attrs", b"x");
    attrs.pax = vec![
        ("SCHILY.xattr.user.origin".into(), b"image".to_vec()),
        ("SCHILY.xattr.trusted.overlay.opaque".into(), b"y".to_vec()),
    ];
    let l = layer(&[
        dir("usr/"),
        suid,
        owned,
        attrs,
        link("bin", b'2', "usr/bin"),
        link("usr/bin/su2", b'1', "usr/bin/su"),
        e("run/fifo", b'6'),
    ]);
    apply(&s, &[gzip(&l)]).unwrap();
    let r = s.root();
    let m = fs::metadata(r.join("usr/bin/su")).unwrap();
    assert_eq!(m.permissions().mode() & 0o7777, 0o4755, "setuid kept");
    assert_eq!(m.nlink(), 2, "hard link made");
    assert_eq!(fs::metadata(r.join("home/u/notes")).unwrap().uid(), 1234);
    assert_eq!(
        fs::read_link(r.join("bin")).unwrap(),
        PathBuf::from("usr/bin")
    );
    assert!(fs::symlink_metadata(r.join("run/fifo"))
        .unwrap()
        .file_type()
        .is_fifo());
    let mut buf = [0u8; 64];
    let v = locker_sys::xattr::get(&r.join("etc/attrs"), c"user.origin", &mut buf);
    if let Ok(v) = v {
        assert_eq!(v, b"image");
    }
    assert!(
        locker_sys::xattr::get(&r.join("etc/attrs"), c"trusted.overlay.opaque", &mut buf).is_err(),
        "trusted.* is dropped"
    );
}

#[test]
fn whiteouts_and_opaque_directories_hide_lower_layers_only() {
    let s = Scratch::new("whiteout");
    let lower = layer(&[
        file("a/x", b"1"),
        file("a/y", b"2"),
        file("b", b"3"),
        file("c/keep", b"4"),
    ]);
    let upper = layer(&[
        file("a/z", b"5"),
        e("a/.wh..wh..opq", b'0'),
        e(".wh.b", b'0'),
        e(".wh.nothing-here", b'0'),
    ]);
    apply(&s, &[lower, upper]).unwrap();
    let r = s.root();
    let mut a: Vec<_> = fs::read_dir(r.join("a"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    a.sort();
    assert_eq!(a, ["z"], "the opaque dir keeps only this layer's entries");
    assert!(!r.join("b").exists());
    assert!(r.join("c/keep").exists());
    assert!(!r.join(".wh.b").exists() && !r.join("a/.wh..wh..opq").exists());
}

#[test]
fn dot_dot_paths_are_refused() {
    let s = Scratch::new("dotdot");
    is_bad(
        apply(&s, &[layer(&[file("../outside/pwned", b"x")])]),
        "climbs out",
    );
    is_bad(
        apply(&s, &[layer(&[file("a/../../outside/pwned", b"x")])]),
        "climbs out",
    );
    assert!(s.outside_is_empty());
}

#[test]
fn a_symlink_pointing_out_never_takes_a_write_out() {
    let s = Scratch::new("symlink");
    let out = s.outside();
    // Absolute, to the host directory: inside the root that path does not exist.
    let l = layer(&[
        link("escape", b'2', out.to_str().unwrap()),
        file("escape/pwned", b"x"),
    ]);
    is_bad(
        apply(&s, &[l]),
        "a symlink whose target is not in the image",
    );
    // Relative, climbing: resolved inside the root it is the root itself.
    let l = layer(&[
        link("up", b'2', "../../../../../../.."),
        file("up/tmp/pwned", b"x"),
        dir("etc/"),
        link("etc2", b'2', "/etc"),
        file("etc2/pwned", b"x"),
    ]);
    apply(&s, &[l]).unwrap();
    assert!(s.outside_is_empty(), "nothing written outside the root");
    assert!(!Path::new("/etc/pwned").exists() && !Path::new("/tmp/pwned").exists());
    assert!(s.root().join("tmp/pwned").is_file());
    assert!(s.root().join("etc/pwned").is_file());
}

#[test]
fn hard_links_must_name_a_file_inside_the_root() {
    let s = Scratch::new("hardlink");
    fs::write(s.outside().join("secret"), b"host").unwrap();
    let target = s.outside().join("secret");
    is_bad(
        apply(
            &s,
            &[layer(&[link("stolen", b'1', target.to_str().unwrap())])],
        ),
        "not in the image",
    );
    is_bad(
        apply(&s, &[layer(&[link("stolen", b'1', "../outside/secret")])]),
        "climbs out",
    );
    // Through a symlink that points out: still resolved inside the root.
    is_bad(
        apply(
            &s,
            &[layer(&[
                link("o", b'2', s.outside().to_str().unwrap()),
                link("stolen", b'1', "o/secret"),
            ])],
        ),
        "not in the image",
    );
    assert!(!s.root().join("stolen").exists());
    assert_eq!(fs::metadata(&target).unwrap().nlink(), 1);
}

#[test]
fn device_nodes_and_sparse_files_are_refused() {
    let s = Scratch::new("devices");
    is_bad(apply(&s, &[layer(&[e("dev/sda", b'4')])]), "device node");
    is_bad(apply(&s, &[layer(&[e("dev/mem", b'3')])]), "device node");
    is_bad(apply(&s, &[layer(&[e("big", b'S')])]), "sparse");
    let mut pax = file("big2", b"");
    pax.pax = vec![("GNU.sparse.major".into(), b"1".to_vec())];
    is_bad(apply(&s, &[layer(&[pax])]), "sparse");
}

#[test]
fn a_ten_gigabyte_file_is_refused_from_its_header_at_once() {
    let s = Scratch::new("huge");
    // Only the header: the refusal must come before any data is needed.
    let mut l = header(b"huge", b'0', 10 << 30, 0o644, 0, b"")
        .as_bytes()
        .to_vec();
    l.extend_from_slice(&[0u8; 4096]);
    let started = Instant::now();
    let r = apply(&s, &[l]);
    assert!(matches!(r, Err(TemplateError::ImageTooBig(_))), "{r:?}");
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(
        !s.root().join("huge").exists() || fs::metadata(s.root().join("huge")).unwrap().len() == 0
    );
}

#[test]
fn a_decompression_bomb_stops_at_the_limit() {
    let s = Scratch::new("bomb");
    // Forty 4 MiB files of zeros: 160 MiB unpacked from well under 1 MiB of gzip.
    let zeros = vec![0u8; 4 << 20];
    let entries: Vec<E> = (0..40).map(|i| file(&format!("z{i}"), &zeros)).collect();
    let bomb = gzip(&layer(&entries));
    assert!(bomb.len() < 1 << 20, "{}", bomb.len());
    let started = Instant::now();
    let mut u = Unpacker::new(&s.root(), limits(32 << 20)).unwrap();
    let r = u.apply(&bomb[..], "layer 1", None);
    assert!(matches!(r, Err(TemplateError::ImageTooBig(_))), "{r:?}");
    assert!(started.elapsed() < Duration::from_secs(10));
}

fn zstd(bytes: &[u8]) -> Vec<u8> {
    ruzstd::encoding::compress_to_vec(bytes, ruzstd::encoding::CompressionLevel::Fastest)
}

#[test]
fn zstd_layers_unpack_frame_after_frame() {
    let s = Scratch::new("zstd");
    let l = layer(&[file("a", b"first"), file("dir/b", &vec![7u8; 300_000])]);
    let diff_id = format!("sha256:{}", hex(&Sha256::digest(&l)));
    // Two frames with a skippable frame (zstd:chunked keeps its metadata in one) between.
    let (one, two) = l.split_at(l.len() / 3);
    let mut z = zstd(one);
    z.extend_from_slice(&[0x5e, 0x2a, 0x4d, 0x18, 3, 0, 0, 0, 1, 2, 3]);
    z.extend_from_slice(&zstd(two));
    let mut u = Unpacker::new(&s.root(), limits(1 << 30)).unwrap();
    let summary = u.apply(&z[..], "layer 1", Some(&diff_id)).unwrap();
    assert_eq!(summary.bytes, 300_005);
    assert_eq!(fs::read(s.root().join("a")).unwrap(), b"first");
    assert_eq!(fs::metadata(s.root().join("dir/b")).unwrap().len(), 300_000);
    // A cut stream is an error, never a short layer.
    let s2 = Scratch::new("zstd-cut");
    let mut u = Unpacker::new(&s2.root(), limits(1 << 30)).unwrap();
    let cut = &z[..z.len() - 40];
    assert!(u.apply(cut, "layer 1", Some(&diff_id)).is_err());
}

#[test]
fn a_zstd_bomb_stops_at_the_limit() {
    let s = Scratch::new("zstd-bomb");
    let zeros = vec![0u8; 4 << 20];
    let entries: Vec<E> = (0..40).map(|i| file(&format!("z{i}"), &zeros)).collect();
    let bomb = zstd(&layer(&entries));
    assert!(bomb.len() < 1 << 20, "{}", bomb.len());
    let started = Instant::now();
    let mut u = Unpacker::new(&s.root(), limits(32 << 20)).unwrap();
    let r = u.apply(&bomb[..], "layer 1", None);
    assert!(matches!(r, Err(TemplateError::ImageTooBig(_))), "{r:?}");
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[test]
fn a_layer_that_does_not_match_its_diff_id_is_refused() {
    let s = Scratch::new("diffid");
    let l = layer(&[file("a", b"1")]);
    let right = format!("sha256:{}", hex(&Sha256::digest(&l)));
    let mut u = Unpacker::new(&s.root(), limits(1 << 20)).unwrap();
    u.apply(&gzip(&l)[..], "layer 1", Some(&right)).unwrap();
    let wrong = format!("sha256:{}", "0".repeat(64));
    let r = u.apply(&l[..], "layer 2", Some(&wrong));
    assert!(
        matches!(&r, Err(TemplateError::BadImage(m)) if m.contains("tampered")),
        "{r:?}"
    );
}

#[test]
fn an_image_config_becomes_the_run_config() {
    let c = br#"{"architecture":"amd64","os":"linux","config":{"Env":["PATH=/bin","GREETING=hi=there"],
        "WorkingDir":"/srv","User":"1000:1000","Entrypoint":["/bin/sh","-c"],"Cmd":["echo hi"],
        "ExposedPorts":{"8080/tcp":{},"53/udp":{}},"Labels":{"a":"b"}},
        "rootfs":{"type":"layers","diff_ids":["sha256:0000000000000000000000000000000000000000000000000000000000000000"]}}"#;
    let cfg = parse_config(c).unwrap();
    assert_eq!(cfg.run.env["GREETING"], "hi=there");
    assert_eq!(cfg.run.workdir.as_deref(), Some("/srv"));
    assert_eq!(cfg.run.user.as_deref(), Some("1000:1000"));
    assert_eq!(
        cfg.run.start_cmd,
        Some(vec!["/bin/sh".into(), "-c".into(), "echo hi".into()])
    );
    assert_eq!(cfg.run.exposed_ports, [53, 8080]);
    assert_eq!(cfg.run.labels["a"], "b");
    assert_eq!(cfg.diff_ids.len(), 1);
    let arm = br#"{"architecture":"arm64","os":"linux","rootfs":{"diff_ids":[]}}"#;
    assert!(matches!(parse_config(arm), Err(TemplateError::BadImage(m)) if m.contains("amd64")));
}

/// A `docker save` archive of `layers` (uncompressed tars) with `config` around them.
fn docker_archive(path: &Path, layers: &[Vec<u8>], env: &str) {
    let diff_ids: Vec<String> = layers
        .iter()
        .map(|l| format!("sha256:{}", hex(&Sha256::digest(l))))
        .collect();
    let config = serde_json::json!({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": [env], "WorkingDir": "/work"},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    })
    .to_string();
    let config_hex = hex(&Sha256::digest(config.as_bytes()));
    let names: Vec<String> = (0..layers.len())
        .map(|i| format!("l{i}/layer.tar"))
        .collect();
    let manifest = serde_json::json!([{"Config": format!("{config_hex}.json"), "RepoTags": ["t:1"], "Layers": names}]).to_string();
    let mut b = tar::Builder::new(fs::File::create(path).unwrap());
    let mut add = |name: &str, data: &[u8]| {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, name, data).unwrap();
    };
    add("manifest.json", manifest.as_bytes());
    add(&format!("{config_hex}.json"), config.as_bytes());
    for (n, l) in names.iter().zip(layers) {
        add(n, l);
    }
    b.finish().unwrap();
}

#[test]
fn a_docker_archive_imports_once_and_a_hostile_one_leaves_nothing() {
    let s = Scratch::new("archive");
    let store = TemplateStore::open(s.0.join("cache")).unwrap();
    let good = s.0.join("good.tar");
    docker_archive(
        &good,
        &[
            layer(&[file("bin/hello", b"hi\n")]),
            layer(&[file("etc/motd", b"m")]),
        ],
        "GREETING=hello",
    );
    let t = store
        .import_image_archive("img", &good, ImageLimits::default(), &mut NoProgress)
        .unwrap();
    assert_eq!(t.config.env["GREETING"], "hello");
    assert_eq!(t.config.workdir.as_deref(), Some("/work"));
    assert!(t.rootfs.join("bin/hello").is_file() && t.rootfs.join("etc/motd").is_file());
    let again = store
        .import_image_archive("img2", &good, ImageLimits::default(), &mut NoProgress)
        .unwrap();
    assert_eq!(again.digest, t.digest, "same image, same template");

    let hostile = s.0.join("hostile.tar");
    docker_archive(
        &hostile,
        &[layer(&[file("ok", b"1"), e("dev/kmsg", b'3')])],
        "X=1",
    );
    let r = store.import_image_archive("bad", &hostile, ImageLimits::default(), &mut NoProgress);
    assert!(
        matches!(&r, Err(TemplateError::BadImage(m)) if m.contains("device node")),
        "{r:?}"
    );
    assert!(store.resolve("bad").unwrap().is_none());
    let leftovers: Vec<_> = fs::read_dir(s.0.join("cache/templates"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with(".tmp-"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    let not_image = s.0.join("plain.tar");
    fs::write(&not_image, layer(&[file("x", b"1")])).unwrap();
    let r =
        store.import_image_archive("plain", &not_image, ImageLimits::default(), &mut NoProgress);
    assert!(
        matches!(&r, Err(TemplateError::BadImage(m)) if m.contains("not an image archive")),
        "{r:?}"
    );
}

/// Builds run pulls on spawned tasks: the future must be `Send`.
#[allow(dead_code)]
fn pull_image_is_send(store: &TemplateStore, source: &ImageSource, p: &mut (dyn Progress + Send)) {
    fn send<T: Send>(_: T) {}
    send(store.pull_image("x", source, ImageLimits::default(), p));
}

#[test]
fn images_sharing_layers_store_them_once_and_never_change_each_other() {
    use std::os::unix::fs::MetadataExt;
    let s = Scratch::new("chains");
    let store = TemplateStore::open(s.0.join("cache")).unwrap();
    let base = layer(&[file("bin/tool", b"tool v1\n"), file("etc/conf", b"a=1\n")]);
    let (a, b) = (s.0.join("a.tar"), s.0.join("b.tar"));
    docker_archive(&a, &[base.clone(), layer(&[file("app/a", b"A")])], "X=a");
    // B removes a file of the shared layer and rewrites another.
    docker_archive(
        &b,
        &[
            base.clone(),
            layer(&[e("etc/.wh.conf", b'0'), file("bin/tool", b"tool v2\n")]),
        ],
        "X=b",
    );
    let ta = store
        .import_image_archive("a", &a, ImageLimits::default(), &mut NoProgress)
        .unwrap();
    let tb = store
        .import_image_archive("b", &b, ImageLimits::default(), &mut NoProgress)
        .unwrap();
    assert_ne!(ta.digest, tb.digest);
    // B's whiteout and rewrite are B's alone.
    assert_eq!(fs::read(ta.rootfs.join("etc/conf")).unwrap(), b"a=1\n");
    assert_eq!(fs::read(ta.rootfs.join("bin/tool")).unwrap(), b"tool v1\n");
    assert!(!tb.rootfs.join("etc/conf").exists() && !tb.rootfs.join("etc/.wh.conf").exists());
    assert_eq!(fs::read(tb.rootfs.join("bin/tool")).unwrap(), b"tool v2\n");
    assert!(!tb.rootfs.join("app/a").exists());
    // The shared layer's files are one inode in both images and in the layer's chain.
    let chains = super::chain::chain_digests(&[format!("sha256:{}", hex(&Sha256::digest(&base)))]);
    let chain = store
        .by_digest(&chains[0])
        .unwrap()
        .expect("the base layer's chain is stored");
    let ino = |p: &Path| fs::metadata(p).unwrap().ino();
    let shared = ino(&chain.rootfs.join("etc/conf"));
    assert_eq!(ino(&ta.rootfs.join("etc/conf")), shared);
    assert_eq!(
        ino(&ta.rootfs.join("bin/tool")),
        ino(&chain.rootfs.join("bin/tool"))
    );
    assert_ne!(
        ino(&tb.rootfs.join("bin/tool")),
        ino(&chain.rootfs.join("bin/tool"))
    );

    // A third image on the stored base never reads that layer again: its member here is
    // garbage, and the import still succeeds (the stored chain was checked against the
    // same diff_id when it was made).
    let c = s.0.join("c.tar");
    docker_archive(&c, &[base.clone(), layer(&[file("app/c", b"C")])], "X=c");
    let garbage = s.0.join("c2.tar");
    {
        let mut out = tar::Builder::new(fs::File::create(&garbage).unwrap());
        let mut ar = tar::Archive::new(fs::File::open(&c).unwrap());
        for entry in ar.entries().unwrap() {
            let mut entry = entry.unwrap();
            let path = entry.path().unwrap().into_owned();
            let mut data = Vec::new();
            std::io::Read::read_to_end(&mut entry, &mut data).unwrap();
            if path == Path::new("l0/layer.tar") {
                data = vec![b'x'; data.len()];
            }
            let mut h = entry.header().clone();
            h.set_cksum();
            out.append_data(&mut h, &path, &data[..]).unwrap();
        }
        out.finish().unwrap();
    }
    let tc = store
        .import_image_archive("c", &garbage, ImageLimits::default(), &mut NoProgress)
        .unwrap();
    assert_eq!(fs::read(tc.rootfs.join("app/c")).unwrap(), b"C");
    assert_eq!(ino(&tc.rootfs.join("etc/conf")), shared);
    // Removing an image leaves the others whole.
    store.remove("a", |_| false).unwrap();
    assert_eq!(fs::read(tc.rootfs.join("etc/conf")).unwrap(), b"a=1\n");
    assert_eq!(
        fs::read(chain.rootfs.join("bin/tool")).unwrap(),
        b"tool v1\n"
    );
}
