//! `locker template …`.

#[derive(clap::Subcommand)]
pub enum TemplateCmd {}

pub fn run(cmd: TemplateCmd) -> anyhow::Result<()> {
    match cmd {}
}
