"""import-linter contract types of gpubook's own (.importlinter names them under contract_types).

`allowlist`: the source modules import nothing but the allowed modules. import-linter's own types
are deny-lists ("forbidden"): a new I/O import that nobody thought to forbid passes them. Here what
the pure core may use is written down, and anything else it starts to import breaks the contract.
"""

from __future__ import annotations

from grimp import ImportGraph
from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


def allowed(module: str, patterns: set[str]) -> bool:
    """Whether `module` is one of `patterns`: a name matches itself; "pkg.**" matches pkg and all below it."""
    for pattern in patterns:
        if pattern.endswith(".**"):
            package = pattern.removesuffix(".**")
            if module == package or module.startswith(package + "."):
                return True
        elif module == pattern:
            return True
    return False


class AllowListContract(Contract):
    """Every module in (or below) `source_modules` imports only modules matching `allowed_modules`
    (direct imports; type-checking-only imports excluded as the session says). A third-party or
    standard-library package is matched by its top-level name (the graph holds no more of it)."""

    type_name = "allowlist"

    source_modules = fields.ListField(subfield=fields.StringField())
    allowed_modules = fields.ListField(subfield=fields.StringField())

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        allow = set(self.allowed_modules)  # type: ignore[arg-type]
        sources: set[str] = set()
        for source in self.source_modules:  # type: ignore[attr-defined]
            sources |= {source, *graph.find_descendants(source)}
        offences = []
        for importer in sorted(sources):
            for imported in sorted(graph.find_modules_directly_imported_by(importer)):
                if not allowed(imported, allow):
                    lines = [d["line_number"] for d in graph.get_import_details(importer=importer, imported=imported)]
                    offences.append({"importer": importer, "imported": imported, "lines": lines})
        return ContractCheck(kept=not offences, metadata={"offences": offences})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for offence in check.metadata["offences"]:
            where = ", ".join(f"l.{line}" for line in offence["lines"])
            output.print_error(f"{offence['importer']} imports {offence['imported']} ({where}), which is not in "
                               "allowed_modules", bold=False)
            output.new_line()
