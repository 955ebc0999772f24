//! The support matrix as a table: every cell of pool × operation × layout × io backend, with
//! the op that runs it or the exact error. Generated from [`crate::plan::decide`], never
//! written by hand (docs/support-matrix.md's copy is checked by a test).

use crate::error::{Result, TransferError};
use crate::geometry::{dsa_bytes_per_token, IoBackend, PoolKind, Profile, MAX_PAGE_SIZE};
use crate::plan::{all_cells, decide, kernel_word, Capabilities, Cell, PathInfo};

/// One row: a cell and its outcome (`Ok(path)` or the error text).
#[derive(Debug, Clone, serde::Serialize)]
pub struct MatrixEntry {
    /// The cell.
    pub cell: Cell,
    /// The path that runs it, or the error text.
    pub outcome: Result<PathInfo, String>,
}

/// The DSA indexer item the matrix assumes: DeepSeek V3.2 (132 B per token) at `page_size`.
pub fn dsa_item(page_size: u64) -> u64 {
    dsa_bytes_per_token(128, 128) * page_size
}

/// Checks a page size given to the matrix (the DSA item must be a real size).
pub fn check_dsa_page_size(dsa_page_size: u64) -> Result<()> {
    if dsa_page_size == 0 {
        return Err(TransferError::PageSizeNotPositive);
    }
    if dsa_page_size > MAX_PAGE_SIZE {
        return Err(TransferError::InvalidConfig(format!("page size {dsa_page_size} exceeds {MAX_PAGE_SIZE} tokens")));
    }
    Ok(())
}

/// Every cell of the table for `pools`, under the portable capabilities: per (pool, operation,
/// layout) the `kernel`, `direct` and `auto` entries. `auto` names the path it takes when only
/// one is allowed, and `kernel or direct` where the executor's calibration decides per call.
pub fn matrix(profile: Profile, pools: &[PoolKind], dsa_page_size: u64) -> Vec<MatrixEntry> {
    let word = kernel_word(profile, &Capabilities::PORTABLE);
    let mut out = Vec::new();
    for pair in all_cells().into_iter().filter(|c| pools.contains(&c.kind)).collect::<Vec<_>>().chunks(2) {
        let item = if pair[0].kind == PoolKind::DsaIndexer { dsa_item(dsa_page_size) } else { 8 };
        let entries: Vec<MatrixEntry> =
            pair.iter().map(|&cell| MatrixEntry { cell, outcome: decide(profile, cell, item, word).map_err(|e| e.to_string()) }).collect();
        let auto = match (profile, &entries[0].outcome, &entries[1].outcome) {
            (Profile::Sglang, _, _) => Err("Unsupported IO backend: auto".to_string()),
            (_, Ok(_), Ok(_)) => Ok(PathInfo { op: "kernel or direct (calibrated per call)", extension: true }),
            (_, Ok(_), Err(_)) => Ok(PathInfo { op: "kernel", extension: true }),
            (_, Err(_), Ok(_)) => Ok(PathInfo { op: "direct", extension: true }),
            (_, Err(e), Err(_)) => Err(e.clone()),
        };
        out.extend(entries);
        out.push(MatrixEntry { cell: Cell { io: IoBackend::Auto, ..pair[0] }, outcome: auto });
    }
    out
}

fn show(o: &Result<PathInfo, String>) -> String {
    match o {
        Ok(p) if p.extension => format!("✔ {} *(extended)*", p.op),
        Ok(p) => format!("✔ `{}`", p.op),
        Err(e) => format!("✘ \"{e}\""),
    }
}

/// Markdown: one row per (pool, op, layout), columns kernel, direct and auto.
pub fn render_markdown(profile: Profile, pools: &[PoolKind], dsa_page_size: u64) -> String {
    let m = matrix(profile, pools, dsa_page_size);
    let mut s = String::new();
    s.push_str(&format!(
        "Profile `{profile}`; DSA indexer item = {} B (132 B/token × page size {dsa_page_size}).\n\n",
        dsa_item(dsa_page_size)
    ));
    s.push_str("| pool | operation | layout | kernel | direct | auto |\n|---|---|---|---|---|---|\n");
    for row in m.chunks(3) {
        let (k, d, a) = (&row[0], &row[1], &row[2]);
        debug_assert!(k.cell.io == IoBackend::Kernel && d.cell.io == IoBackend::Direct && a.cell.io == IoBackend::Auto);
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} |\n",
            k.cell.kind,
            k.cell.op.name(),
            k.cell.layout,
            show(&k.outcome),
            show(&d.outcome),
            show(&a.outcome)
        ));
    }
    s.push_str(&format!("\n{}\n", checksum_note(profile)));
    s
}

/// Where item checksums are recorded and verified, for the matrix and `hicache-io info`.
pub fn checksum_note(profile: Profile) -> String {
    let default = match profile {
        Profile::Extended => "on by default in this profile (`HostPoolConfig::integrity = Some(false)` turns them off)",
        Profile::Sglang => "off by default in this profile (`HostPoolConfig::integrity = Some(true)` turns them on)",
    };
    format!(
        "Item checksums are {default}. They are recorded by backups and verified by loads inside the copy: on the cpu \
         executor in `kernel` and `direct` copies, on wgpu and cuda in `kernel` copies (their `direct` copies leave \
         the items they write unknown and read them unverified)."
    )
}
