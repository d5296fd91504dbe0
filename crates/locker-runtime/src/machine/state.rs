//! What a machine's directory says it is: a jail ([`JailState`], `state.json`: its shim and
//! its agent, PID 1) or a microVM ([`VmState`], `vm.json`: its QEMU). Each runtime writes
//! its own record with its own processes; this room reads either back, for adoption and
//! teardown, and answers the questions both share (its uid range, its agent's socket).
//!
//! It does not write these records (the runtimes do, when they start a machine) and does
//! not judge whether their processes live (see [`crate::jail::is_alive`],
//! [`crate::vm::is_alive`]).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::jail::JailState;
use crate::vm::VmState;

/// The isolation backend of a machine.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RuntimeKind {
    #[default]
    Jail,
    Microvm,
}

impl RuntimeKind {
    pub fn as_str(self) -> &'static str {
        match self {
            RuntimeKind::Jail => "jail",
            RuntimeKind::Microvm => "microvm",
        }
    }
}

/// A machine as its runtime recorded it.
#[derive(Debug, Clone)]
pub enum MachineState {
    Jail(JailState),
    Vm(VmState),
}

impl MachineState {
    /// Reads the record a started machine left in `dir`. A microVM started by an earlier
    /// version also left a `state.json` (QEMU's pid as both shim and agent): its `vm.json`
    /// decides.
    pub fn load(dir: &Path) -> Option<Self> {
        match VmState::load(dir) {
            Some(v) => Some(Self::Vm(v)),
            None => JailState::load(dir).map(Self::Jail),
        }
    }

    pub fn kind(&self) -> RuntimeKind {
        match self {
            Self::Jail(_) => RuntimeKind::Jail,
            Self::Vm(_) => RuntimeKind::Microvm,
        }
    }

    pub fn id(&self) -> &str {
        match self {
            Self::Jail(s) => &s.id,
            Self::Vm(v) => &v.id,
        }
    }

    pub fn dir(&self) -> &Path {
        match self {
            Self::Jail(s) => &s.dir,
            Self::Vm(v) => &v.dir,
        }
    }

    /// The first host uid of the machine's range (its root inside a jail, its QEMU's uid).
    pub fn uid_base(&self) -> u32 {
        match self {
            Self::Jail(s) => s.uid_base,
            Self::Vm(v) => v.uid,
        }
    }

    /// The host end of the agent's channel: the same name in either runtime.
    pub fn socket(&self) -> PathBuf {
        self.dir().join("agent.sock")
    }

    /// Whether the machine's processes still run (its shim and agent, or its QEMU).
    pub fn is_alive(&self) -> bool {
        match self {
            Self::Jail(s) => crate::jail::is_alive(s),
            Self::Vm(v) => crate::vm::is_alive(v),
        }
    }

    pub fn as_jail(&self) -> Option<&JailState> {
        match self {
            Self::Jail(s) => Some(s),
            Self::Vm(_) => None,
        }
    }

    pub fn as_vm(&self) -> Option<&VmState> {
        match self {
            Self::Vm(v) => Some(v),
            Self::Jail(_) => None,
        }
    }
}
