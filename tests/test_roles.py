"""One table says what a role may do: the admin's page capabilities follow from each role's
scopes, so a role never opens a page whose service would refuse it."""

from zeromem.kernel.scopes import CAPABILITIES, CAPABILITY_SCOPES, ROLE_SCOPES, Capability, Role

EVERY_ROLE = {Role.VIEWER, Role.SUPPORT, Role.COMPLIANCE, Role.ADMIN}


def test_each_capability_belongs_to_the_roles_whose_scopes_it_needs():
    assert CAPABILITIES == {
        Capability.TENANT_VIEW: EVERY_ROLE,
        Capability.DASHBOARD_VIEW: EVERY_ROLE,
        Capability.MEMORY_VIEW: {Role.VIEWER, Role.SUPPORT, Role.ADMIN},
        Capability.MEMORY_EDIT: {Role.SUPPORT, Role.ADMIN},
        Capability.FORGET_VIEW: EVERY_ROLE,
        Capability.FORGET_CREATE: {Role.SUPPORT, Role.COMPLIANCE, Role.ADMIN},
        Capability.AUDIT_VIEW: {Role.COMPLIANCE, Role.ADMIN},
        Capability.KEYS_MANAGE: {Role.ADMIN},
        Capability.MEMBERS_MANAGE: {Role.ADMIN},
    }


def test_every_role_and_capability_is_in_the_table():
    assert set(ROLE_SCOPES) == set(Role.values)
    assert set(CAPABILITY_SCOPES) == set(Capability.values)
